"""`benchmarks/multi_gpu.py`: its smoke mode end to end on 2 gloo ranks, every GPU row's job valid at 2 and 4
GPUs, and the table's arithmetic (ratios, bubble) on made-up records. No number is checked for speed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.bench_fixtures import BENCH, benchmarks_on_path, import_benchmark
from tests.engine_fixtures import subprocess_env


@pytest.fixture(scope="module")
def bench():
    yield from import_benchmark("multi_gpu")


def _args(**overrides):
    args = {
        "smoke": False,
        "cp_seq": 8192,
        "pp_microbatch": 2,
        "microbatch": 8,
        "ray_rows": "*",
        "rows": "*",
        "launchers": "torchrun,ray",
        "warmup": 3,
        "steps": 10,
        "cpus_per_rank": 4,
        "set": [],
        "variant": [],
        "variants_on_1gpu": False,
        "profile": "",
        "profile_steps": 3,
        "profile_trace": False,
        "concurrent_1gpu": False,
        "numa_binding": None,
    }
    return argparse.Namespace(**{**args, **overrides})


def test_concurrent_1gpu_rows_each_get_their_own_gpu(bench, monkeypatch, tmp_path: Path) -> None:
    """`--concurrent-1gpu`: the 1-GPU torchrun rows (not the Ray ones, not multi-GPU rows) run at most N at a
    time, no two at once on one GPU, every row once."""
    import threading

    args = _args(concurrent_1gpu=True, ray_rows="moe-1gpu", timeout_per_row=60.0)
    rows = bench.select(bench.all_rows(2, args), args)
    together = bench.concurrent_rows(rows, args, 2)
    assert {r.id for r in together} == {"dense-1gpu", "moe-1gpu", "titan-dense-1gpu", "titan-moe-1gpu"}
    assert bench.concurrent_rows(rows, _args(), 2) == []  # off by default
    assert bench.concurrent_rows(rows, args, 1) == []  # one GPU: nothing to run beside

    lock, running, seen = threading.Lock(), set(), []
    peak = [0]

    def fake_run_row(row, args, work, timeout, gpu=None):
        with lock:
            assert gpu not in running, f"GPU {gpu} given to two rows at once"
            running.add(gpu)
            peak[0] = max(peak[0], len(running))
        time.sleep(0.05)
        with lock:
            running.discard(gpu)
            seen.append((row.id, gpu))
        return {"tokens_per_s": 1.0}

    monkeypatch.setattr(bench, "run_row", fake_run_row)
    entries = list(bench.run_concurrently(together, args, tmp_path, 2, lambda: 1e9))
    assert sorted(e["id"] for e in entries) == sorted(r.id for r in together)
    assert all(e["gpu"] in (0, 1) and e["tokens_per_s"] == 1.0 for e in entries)
    assert peak[0] == 2 and len(seen) == len(together)
    # out of budget: recorded as skipped, nothing run
    seen.clear()
    skipped = list(bench.run_concurrently(together, args, tmp_path, 2, lambda: 0.0))
    assert seen == [] and all(e["error"] == "skipped: out of the --budget-s time" for e in skipped)


@pytest.mark.distributed
def test_smoke_runs_rows_on_two_gloo_ranks(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [
        sys.executable,
        str(BENCH / "multi_gpu.py"),
        "--smoke",
        "--rows",
        "dense-1gpu,moe-fsdp-ep,dense-pp-1f1b",
        # two ranks' profiles of the expert-parallel row (all-to-all, FSDP's collectives) and one 1-rank one
        "--profile",
        "moe-fsdp-ep,dense-1gpu",
        "--profile-steps",
        "2",
    ]
    cmd += ["--launchers", "torchrun", "--out", str(out), "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(
        cmd, env=subprocess_env(GLOO_SOCKET_IFNAME="lo"), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["gpus"] == 2 and report["torch"]
    rows = {r["id"]: r for r in report["results"]}
    assert list(rows) == ["dense-1gpu", "dense-pp-1f1b", "moe-fsdp-ep"], rows.keys()
    for row in rows.values():
        assert "error" not in row, (row["id"], row.get("error"), row.get("log_tail"))
        for key in ("tokens_per_s", "tokens_per_s_per_gpu", "median_step_s", "mfu", "peak_gib"):
            assert key in row, (row["id"], key)
        assert row["tokens_per_s"] > 0 and len(row["step_s"]) == 2  # --smoke: 2 timed steps
        assert row["mean_step_s"] == pytest.approx(sum(row["step_s"]) / 2)
        assert row["max_step_s"] == max(row["step_s"])
        assert ("scaling" in row) == (row["model"] == "dense")  # no moe-1gpu row ran
        # the engine's own account of its set-up, per rank (compile is off on CPU)
        assert any("compile: off" in line for line in row["setup"]), row["setup"]
    assert any("fsdp: " in line for line in rows["moe-fsdp-ep"]["setup"]), rows["moe-fsdp-ep"]["setup"]
    moe = rows["moe-fsdp-ep"]
    assert moe["tokens_per_s_per_gpu"] == pytest.approx(moe["tokens_per_s"] / 2)
    assert rows["dense-1gpu"]["scaling"] == pytest.approx(1.0)
    # --profile: after the 1 + 2 timed steps, a profiler warm-up step (4), then steps 5 and 6
    assert "profile" not in rows["dense-pp-1f1b"]
    for row_id, ranks in (("moe-fsdp-ep", 2), ("dense-1gpu", 1)):
        p = rows[row_id]["profile"]
        assert "error" not in p and p["steps"] == [5, 6] and len(p["ranks"]) == ranks, p
        assert [r["rank"] for r in p["ranks"]] == list(range(ranks))
        assert "top_kernels_ms_per_step" in p["ranks"][0] and all(
            "top_kernels_ms_per_step" not in r for r in p["ranks"][1:]
        )  # the heaviest ops of rank 0 only: a small result
        for r in p["ranks"]:
            assert r["source"] == "cpu ops" and r["steps"] == 2
            busy, step = r["busy_ms_per_step"], r["step_ms"]
            assert 0 < busy["compute"] <= step and busy["exposed communication"] >= 0
            assert busy["exposed communication"] <= busy["communication"] + 1e-9 <= step + 1e-9
            assert busy["compute"] + busy["exposed communication"] + busy["idle"] == pytest.approx(step)
            assert r["ms_per_step"]["idle gaps"] == pytest.approx(busy["idle"])
            # categories are sums of intervals: at least the union of what they cover
            work = sum(ms for key, ms in r["ms_per_step"].items() if key != "idle gaps")
            assert work >= busy["compute"] + busy["communication"] - 1e-6
            assert r["host_syncs"]["per_step"] >= 0 and r["host_syncs"]["ms_per_step"] <= step
        spread = p["across_ranks"]
        assert spread["busy_ms_per_step"]["compute"]["max"] == max(
            r["busy_ms_per_step"]["compute"] for r in p["ranks"]
        )
        assert len(p["slowest_rank_per_step"]) == 2 and set(p["slowest_rank_per_step"]) <= set(range(ranks))
    moe_ranks = rows["moe-fsdp-ep"]["profile"]["ranks"]
    for category in ("all-to-all", "all-gather", "reduce-scatter"):  # EP exchange and FSDP, on gloo
        assert all(r["ms_per_step"][category] > 0 for r in moe_ranks), category
    assert "profile moe-fsdp-ep (steps 5..6, 2 ranks, cpu ops)" in proc.stdout
    bubble = rows["dense-pp-1f1b"]["pipeline"]
    assert bubble["microbatches"] == 8
    assert 0.0 <= bubble["bubble_measured"] < 1.0
    assert bubble["bubble_sim_unit"] == pytest.approx(1 / 9)  # 1F1B: (p - 1) / (m + p - 1)
    assert set(bubble["pass_median_s"]) == {"0F", "0B", "1F", "1B"}
    assert "| dense-pp-1f1b |" in proc.stdout  # the markdown table
    medians = bubble["pass_median_s"]
    work = [1e3 * (medians[f"{s}F"] + medians[f"{s}B"]) for s in (0, 1)]
    assert f"dense-pp-1f1b: stage ms per microbatch 0: {work[0]:.1f}, 1: {work[1]:.1f}" in proc.stdout


def test_every_gpu_row_is_a_valid_job(bench, tmp_path: Path) -> None:
    from d9d.cluster.spec import build_job
    from d9d.core.mesh_params import DeviceMeshParameters
    from d9d.engine.config import parse_config

    for n, microbatch in ((2, 8), (4, 8), (2, 2)):
        rows = bench.all_rows(n, _args(microbatch=microbatch))
        ids = {r.id for r in rows}
        assert {
            "dense-fsdp@ray",
            "moe-pp-zbv",
            "titan-moe-fsdp-ep",
            "dense-pp-dualpipev",
            "titan-dense-tp-fsdp",
        } <= ids
        for row in rows:
            assert DeviceMeshParameters(**row.mesh).world_size == row.gpus, row
            if row.pp == 1 and "context_parallel_shard" not in row.mesh:  # `--microbatch`'s rows
                assert row.microbatch == microbatch, row
            assert bench.global_batch(row, smoke=False) * row.seq == 8 * 2048 * row.gpus, row
            if row.framework != "d9d":
                flags = bench.titan_flags(row, _args(microbatch=microbatch), tmp_path)
                value = {flags[i]: flags[i + 1] for i in range(len(flags) - 1) if flags[i].startswith("--")}
                degrees = [
                    int(value[f"--parallelism.{d}_degree"])
                    for d in ("data_parallel_shard", "tensor_parallel")
                ]
                assert degrees[0] * degrees[1] == row.gpus, row  # torchtitan's mesh covers the row's GPUs
                # its global batch (local batches accumulated over its data-parallel ranks) is d9d's
                local, total = (
                    int(value["--training.local_batch_size"]),
                    int(value["--training.global_batch_size"]),
                )
                assert total == bench.global_batch(row, smoke=False) and total % (local * degrees[0]) == 0, (
                    row
                )
                continue
            job = bench.d9d_job(row, _args(microbatch=microbatch), Path(tempfile.mkdtemp(dir=tmp_path)))
            if row.launcher == "ray":
                spec = build_job(job)
                assert spec.cluster.resources.gpus == 1 and spec.cluster.max_failures == 0
                continue
            config = parse_config(job)
            assert config.compile.enabled is True and config.gradient_clipping.max_norm is None
            assert (
                config.batching.gradient_accumulation(config.mesh.data_parallel)
                * row.microbatch
                * (config.mesh.data_parallel)
                == config.batching.global_batch_size
            )


def test_profiled_rows_and_the_dedup_exchange_variant_are_valid_jobs(bench, tmp_path: Path) -> None:
    """The GPU command of docs/benchmarks.md: `--profile` rows and the variant that turns the deduplicated
    expert exchange on."""
    with benchmarks_on_path():
        from throughput.data import RandomTokens
    from d9d.engine.config import apply_overrides, parse_config
    from d9d.parallel.expert import AllToAllBackendConfig

    backend = "model.options.parallel.expert_backend"
    args = _args(
        rows="moe-1gpu,moe-fsdp-ep*",  # `*`: the variant row's id is moe-fsdp-ep+dedup
        launchers="torchrun",
        profile="moe-fsdp-ep*",
        profile_steps=3,
        variant=[f"dedup:{backend}.kind=all_to_all;{backend}.dedup=true"],
    )
    rows = bench.select(bench.all_rows(4, args), args)
    assert [r.id for r in rows] == ["moe-1gpu", "moe-fsdp-ep", "moe-fsdp-ep+dedup"]
    for row in rows:
        assert bench.profiled(row, args) == (row.id != "moe-1gpu")  # the globs see variant ids
        (row_dir := tmp_path / row.id).mkdir()
        cmd, job = bench.row_command(row, args, row_dir)
        sets = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]
        config = parse_config(apply_overrides(job, sets))
        options = RandomTokens.Config(**job["data"]["options"])
        if bench.profiled(row, args):
            # 3 warm-up + 10 timed steps, the profiler's warm-up step 14, profiled 15..17, and step 18 to
            # write them
            assert (options.profile_from, options.profile_steps, options.profile_trace) == (15, 3, False)
            assert config.trainer.total_steps == 18
        else:
            assert options.profile_from is None and config.trainer.total_steps == 14
        want = AllToAllBackendConfig(dedup=True) if row.variant == "dedup" else None
        if want is not None:
            assert config.model.options.parallel.expert_backend == want


def test_rows_run_in_priority_order_and_select_by_glob(bench) -> None:
    rows = bench.select(
        bench.all_rows(4, _args(ray_rows=bench.DEFAULT_RAY_ROWS)), _args(rows="dense-*,titan-*")
    )
    ids = [r.id for r in rows]
    assert ids[:4] == ["dense-1gpu", "titan-dense-1gpu", "dense-fsdp", "titan-dense-fsdp"]
    assert "dense-fsdp@ray" in ids and "dense-hsdp@ray" not in ids and "moe-1gpu" not in ids
    only_ray = bench.select(bench.all_rows(4, _args()), _args(launchers="ray", rows="dense-*"))
    assert all(r.launcher == "ray" for r in only_ray)


def test_ratios(bench) -> None:
    def row(row_id, gpus, tps, framework="d9d", launcher="torchrun", model="dense", seq=2048):
        return {
            "id": row_id,
            "model": model,
            "framework": framework,
            "launcher": launcher,
            "gpus": gpus,
            "layout": f"{gpus} GPU(s)",
            "seq": seq,
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / gpus,
        }

    results = [
        row("dense-1gpu", 1, 100.0),
        row("titan-dense-1gpu", 1, 110.0, framework="torchtitan"),
        row("dense-fsdp", 4, 360.0),
        row("dense-fsdp@ray", 4, 342.0, launcher="ray"),
        row("titan-dense-fsdp", 4, 400.0, framework="torchtitan"),
        row("dense-cp-fsdp", 4, 300.0, seq=8192),
        {
            "id": "moe-1gpu",
            "model": "moe",
            "framework": "d9d",
            "launcher": "torchrun",
            "gpus": 1,
            "layout": "1 GPU",
            "seq": 2048,
            "error": "x",
        },
        row("moe-fsdp-ep", 4, 200.0, model="moe"),
    ]
    bench.add_ratios(results)
    by_id = {r["id"]: r for r in results}
    assert by_id["dense-fsdp"]["scaling"] == pytest.approx(0.9)
    assert by_id["dense-fsdp"]["x_titan"] == pytest.approx(0.9)
    assert by_id["dense-fsdp@ray"]["x_torchrun"] == pytest.approx(0.95)
    assert by_id["titan-dense-fsdp"]["scaling"] == pytest.approx(100 / 110)
    assert by_id["dense-1gpu"]["x_titan"] == pytest.approx(100 / 110)
    assert "x_titan" not in by_id["dense-cp-fsdp"] and "scaling" not in by_id["dense-cp-fsdp"]  # longer seq
    assert "scaling" not in by_id["moe-fsdp-ep"] and "x_titan" not in by_id["moe-fsdp-ep"]  # no reference
    table = bench.table(results)
    assert "0.95x torchrun" in table and "failed: x" in table


def test_repeated_rows_run_in_alternating_order_and_compare_within_their_pass(bench) -> None:
    rows = bench.select(bench.all_rows(2, _args()), _args(rows="dense-1gpu,dense-fsdp*"))
    ids = [r.id for r in bench.repeated(rows, 3)]
    first = [r.id for r in rows]
    assert first[:2] == ["dense-1gpu", "dense-fsdp"] and "dense-fsdp@ray" in first
    assert ids == [*first, *(f"{i}#2" for i in reversed(first)), *(f"{i}#3" for i in first)]
    assert bench.base_id("dense-fsdp+f32@ray#2") == "dense-fsdp@ray"
    assert bench.split_pass("dense-fsdp@ray#2") == ("dense-fsdp@ray", "#2")

    def row(row_id, gpus, tps, launcher="torchrun", framework="d9d"):
        return {
            "id": row_id,
            "model": "dense",
            "framework": framework,
            "launcher": launcher,
            "gpus": gpus,
            "seq": 2048,
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / gpus,
        }

    results = [
        row("dense-1gpu", 1, 100.0),
        row("dense-fsdp", 2, 180.0),
        row("dense-fsdp@ray", 2, 171.0, launcher="ray"),
        row("titan-dense-fsdp", 2, 150.0, framework="torchtitan"),
        row("dense-fsdp+f32", 2, 162.0),
        row("dense-1gpu#2", 1, 90.0),
        row("dense-fsdp#2", 2, 190.0),
        row("dense-fsdp@ray#2", 2, 190.0, launcher="ray"),
        row("dense-fsdp+f32#2", 2, 95.0),
    ]
    bench.add_ratios(results)
    by_id = {r["id"]: r for r in results}
    assert by_id["dense-fsdp@ray"]["x_torchrun"] == pytest.approx(0.95)
    assert by_id["dense-fsdp@ray#2"]["x_torchrun"] == pytest.approx(1.0)
    assert by_id["dense-fsdp#2"]["scaling"] == pytest.approx(95 / 90)  # against the 1-GPU row of pass 2
    assert by_id["dense-fsdp+f32#2"]["x_base"] == pytest.approx(0.5)
    assert by_id["dense-fsdp"]["x_titan"] == pytest.approx(1.2)
    assert "x_titan" not in by_id["dense-fsdp#2"]  # no torchtitan row in pass 2: none of pass 1's


def test_bubble_from_records(bench) -> None:
    with benchmarks_on_path():
        from throughput.bubble import pipeline_bubble

    def rank(stage, span, forward, backward):  # the same two steps; 4 microbatches
        passes = [("F", stage, forward)] * 4 + [("B", stage, backward)] * 4
        return {"pipeline": {step: {"span_s": span, "passes": passes} for step in (1, 2)}}

    # 1F1B, pp 2, 4 microbatches, F = 1 and B = 2 (= I + W at unit costs): the makespan is (m + p - 1) × 3 =
    # 15, each rank busy 12 -> bubble 1/5, measured, simulated with these costs and with unit costs alike.
    result = pipeline_bubble([rank(0, 15.0, 1.0, 2.0), rank(1, 15.0, 1.0, 2.0)], [1, 2], "1f1b", 2, 4)
    assert result["pass_median_s"] == {"0B": 2.0, "0F": 1.0, "1B": 2.0, "1F": 1.0}
    assert result["bubble_measured"] == pytest.approx(0.2)
    assert result["bubble_sim"] == pytest.approx(0.2)
    assert result["bubble_sim_unit"] == pytest.approx(0.2)
    # A slower last stage: the simulator's prediction with the measured costs moves, the unit one does not.
    uneven = pipeline_bubble([rank(0, 20.0, 1.0, 2.0), rank(1, 20.0, 2.0, 3.0)], [1, 2], "1f1b", 2, 4)
    assert uneven["bubble_measured"] == pytest.approx(1 - (12 + 20) / (2 * 20))
    assert uneven["bubble_sim"] > 0.2 and uneven["bubble_sim_unit"] == pytest.approx(0.2)


def test_measured_bubble_is_the_simulators_quantity_when_a_rank_finishes_first(bench) -> None:
    """Probe records made from the simulator's own timeline (each rank's passes, its span from the step's
    start to its last pass) measure the simulator's bubble: idle time of all ranks over ranks × makespan,
    also for the rank that ends before the step does (1F1B's last stage, by one backward of the first)."""
    with benchmarks_on_path():
        from throughput.bubble import StageCosts, pipeline_bubble

    from pydantic import TypeAdapter

    from d9d.pipeline.schedule.config import ScheduleConfig, build_schedule
    from d9d.pipeline.simulator.simulate import simulate

    costs = {"0F": 18.0, "0B": 39.0, "1F": 42.0, "1B": 42.0}  # session 33's pp 2 row at 2 microbatches
    program = build_schedule(TypeAdapter(ScheduleConfig).validate_python({"kind": "1f1b"}), 2, 2)
    result = simulate(program, StageCosts(per_stage=costs))
    records = []
    for timeline in result.timeline:
        passes = [
            ("F" if t.action.kind.name == "FORWARD" else "B", t.action.stage, t.end - t.start)
            for t in timeline
        ]
        span = max(t.end for t in timeline)
        records.append({"pipeline": {1: {"span_s": span, "passes": passes}}})
    spans = [r["pipeline"][1]["span_s"] for r in records]
    assert spans[1] < spans[0] == result.makespan  # the last stage ends first
    measured = pipeline_bubble(records, [1], "1f1b", 2, 2)
    assert measured["pass_median_s"] == costs
    assert measured["bubble_measured"] == pytest.approx(result.bubble_fraction)
    assert measured["bubble_measured"] == pytest.approx(measured["bubble_sim"])
    # each rank over its own span (the definition before session 33) leaves the last stage's tail out
    own = measured["bubble_own_span_per_rank"]
    assert sum(own) / len(own) < result.bubble_fraction - 0.05


def test_variants_sweep_settings(bench, tmp_path: Path) -> None:
    from d9d.engine.config import apply_overrides, parse_config

    fsdp = "model.options.parallel.fsdp"
    variants = [
        f"f32:{fsdp}.reduce_dtype=float32",
        f"pf:{fsdp}.forward_prefetch=2;{fsdp}.backward_prefetch=3",
    ]
    args = _args(variant=variants, rows="dense-1gpu,dense-fsdp*", ray_rows="dense-fsdp")
    rows = bench.select(bench.all_rows(4, args), args)
    ids = [r.id for r in rows]
    assert ids == [
        "dense-1gpu",  # nothing to shard on one GPU: no variants
        "dense-fsdp",
        "dense-fsdp+f32",
        "dense-fsdp+pf",
        "dense-fsdp@ray",
        "dense-fsdp+f32@ray",
        "dense-fsdp+pf@ray",
    ], ids
    by_id = {r.id: r for r in rows}
    for row_id, want in [
        ("dense-fsdp", {}),
        ("dense-fsdp+f32", {"reduce_dtype": "float32"}),
        ("dense-fsdp+pf@ray", {"forward_prefetch": 2, "backward_prefetch": 3}),
    ]:
        row = by_id[row_id]
        (row_dir := tmp_path / row.id.replace("@", "_")).mkdir()
        cmd, job = bench.row_command(row, _args(set=["trainer.total_steps=7"]), row_dir)
        sets = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]
        assert sets[0] == "trainer.total_steps=7" and len(sets) == 1 + len(row.sets), (row_id, sets)
        if row.launcher == "torchrun":
            config = parse_config(apply_overrides(job, sets))
            got = config.model.options.parallel.fsdp.model_dump(exclude_defaults=True)
            assert got == want, (row_id, got)
    one_gpu = _args(
        variant=["cg:compile.mode=reduce-overhead"],
        rows="dense-1gpu*,titan-dense-1gpu",
        launchers="torchrun",
        variants_on_1gpu=True,
    )
    assert [r.id for r in bench.select(bench.all_rows(2, one_gpu), one_gpu)] == [
        "dense-1gpu",
        "dense-1gpu+cg",  # `--variants-on-1gpu`: d9d's 1-GPU rows too, never torchtitan's
        "titan-dense-1gpu",
    ]
    # a variant's microbatch is its row's: the pipeline rows simulate their bubble at that many microbatches
    pp = _args(variant=["mb4:batching.microbatch_size=4"], rows="dense-pp-1f1b*", launchers="torchrun")
    assert {r.id: r.microbatch for r in bench.select(bench.all_rows(2, pp), pp)} == {
        "dense-pp-1f1b": 2,
        "dense-pp-1f1b+mb4": 4,
    }
    for bad in ("noname", "x:", "x:novalue", "a b:k=v"):
        with pytest.raises(ValueError, match="--variant"):
            bench.parse_variant(bad)
    with pytest.raises(ValueError, match="repeat"):
        bench.with_variants([], ["a:k=v", "a:k=w"])

    def measured(row_id, tps):
        return {
            "id": row_id,
            "model": "dense",
            "framework": "d9d",
            "launcher": "torchrun",
            "gpus": 4,
            "layout": "FSDP 4",
            "seq": 2048,
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / 4,
        }

    results = [measured("dense-fsdp", 400.0), measured("dense-fsdp+f32", 380.0)]
    bench.add_ratios(results)
    assert results[1]["x_base"] == pytest.approx(0.95) and "x_base" not in results[0]
    assert "0.95x base" in bench.table(results)


@pytest.fixture(scope="module")
def prof_mod():
    yield from import_benchmark("throughput.profile")


def test_interval_arithmetic(prof_mod) -> None:
    assert prof_mod.merge([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]  # touching intervals join
    assert prof_mod.union_length([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6.5)]) == 6
    assert prof_mod.union_length([]) == 0
    assert prof_mod.overlap_length([(0, 10)], [(2, 3), (5, 12)]) == 6
    # unsorted and self-overlapping on both sides: (∪a) = [0, 6], (∪b) = [1, 2] ∪ [5, 8]
    assert prof_mod.overlap_length([(2, 6), (0, 4)], [(5, 8), (1, 2)]) == 2
    assert prof_mod.overlap_length([(0, 1)], [(1, 2)]) == 0
    assert prof_mod.overlap_length([], [(0, 1)]) == 0


def test_categories_of_collectives(prof_mod) -> None:
    cat = prof_mod.categorize
    assert cat("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "send/recv (p2p or all-to-all)"
    assert cat("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "all-gather"
    assert cat("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)") == "reduce-scatter"
    assert cat("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)") == "all-reduce"
    assert cat("ncclDevKernel_Broadcast_RING_LL(x)") == "broadcast"
    assert cat("c10d::alltoall_base_") == cat("gloo:all_to_all") == "all-to-all"
    assert (
        cat("c10d::_reduce_scatter_base_") == "reduce-scatter"
        and cat("c10d::barrier") == "communication (other)"
    )
    assert cat("fsdp::all_gather_copy_in") == "dtype copies"  # a copy, not the collective
    assert cat("_gather_sum_kernel") == "moe token movement" and cat("aten::addmm") == "matmul"
    assert {"all-to-all", "all-gather", "send/recv (p2p or all-to-all)"} <= prof_mod.COMMUNICATION_CATEGORIES


def test_breakdown_of_kernels_and_host_syncs(prof_mod) -> None:
    ev = prof_mod.Event
    kernels = [  # (name, start, end, stream): compute on stream 7, NCCL on stream 20; microseconds
        ev("ampere_bf16_gemm", 0, 40, 7, True),
        ev("elementwise_kernel", 50, 60, 7, True),
        ev("ncclDevKernel_SendRecv", 30, 70, 20, True),
        ev("ncclDevKernel_AllGather_RING_LL", 80, 90, 20, True),
    ]
    host = [  # thread 1: .item() (nested), .cpu() (copy then sync), an H2D copy, torch.cuda.synchronize()
        ev("aten::item", 100, 130, 1),
        ev("aten::_local_scalar_dense", 101, 129, 1),
        ev("cudaMemcpyAsync", 102, 120, 1),
        ev("cudaStreamSynchronize", 121, 128, 1),
        ev("aten::copy_", 200, 230, 1),
        ev("cudaMemcpyAsync", 201, 225, 1),
        ev("cudaStreamSynchronize", 226, 229, 1),
        ev("aten::copy_", 300, 305, 1),
        ev("cudaMemcpyAsync", 301, 304, 1),  # not a sync: the next sync is not in its op
        ev("cudaDeviceSynchronize", 400, 410, 1),
        ev("aten::mm", 500, 600, 1),  # host ops are not work when there are kernels
    ]
    report = prof_mod.breakdown_events(kernels + host, wall_s=1e-3, steps=2)  # 0.5 ms per step
    assert report["source"] == "cuda kernels" and report["step_ms"] == pytest.approx(0.5)
    busy = report["busy_ms_per_step"]
    # compute [0,40] ∪ [50,60] = 50 µs; communication [30,70] ∪ [80,90] = 50 µs, of which [30,40] and
    # [50,60] run beside compute: 30 µs exposed; idle 1000 − 50 − 30 = 920 µs; per step: / 2 / 1000
    assert busy == pytest.approx(
        {"compute": 0.025, "communication": 0.025, "exposed communication": 0.015, "idle": 0.46}
    )
    assert sum(busy[k] for k in ("compute", "exposed communication", "idle")) == pytest.approx(0.5)
    rows = report["ms_per_step"]
    assert rows["matmul"] == pytest.approx(0.02) and rows["elementwise/reduce"] == pytest.approx(0.005)
    assert rows["send/recv (p2p or all-to-all)"] == pytest.approx(0.02)
    assert rows["all-gather"] == pytest.approx(0.005) and rows["idle gaps"] == pytest.approx(0.46)
    syncs = report["host_syncs"]
    # item: copy + sync [102,128] 26 µs; .cpu(): copy + sync [201,229] 28 µs; device sync 10 µs -> 3 syncs,
    # 64 µs; each named by the innermost op around it
    assert syncs["per_step"] == pytest.approx(1.5) and syncs["ms_per_step"] == pytest.approx(0.032)
    assert syncs["by_site"] == {
        "aten::_local_scalar_dense": pytest.approx([0.5, 0.013]),
        "aten::copy_": pytest.approx([0.5, 0.014]),
        "cudaDeviceSynchronize": pytest.approx([0.5, 0.005]),
    }
    assert report["top_kernels_ms_per_step"][0] == ("ampere_bf16_gemm", pytest.approx(0.02), 0)


def test_idle_gaps_are_named_by_the_launch_that_ends_them(prof_mod) -> None:
    ev = prof_mod.Event
    events = [  # (name, start, end, stream or thread, device, correlation); microseconds, 2 steps
        ev("gemm_a", 0, 10, 7, True, 1),
        ev("gemm_b", 50, 60, 7, True, 2),  # 40 µs gap, launched from aten::mm inside d9d's step
        ev("add_c", 62, 70, 7, True, 3),  # 2 µs gap: under the threshold
        ev("add_d", 100, 110, 7, True, 4),  # 30 µs gap, no host event recorded: named by the kernels
        ev("add_e", 105, 108, 8, True, 5),  # inside add_d's span on another stream: no gap
        ev("gemm_f", 150, 160, 7, True, 6),  # 40 µs gap, also from aten::mm in the same frame
        ev("/x/d9d/engine/step.py(10): run", 0, 200, 1),
        ev("torch/nn/functional.py(5): linear", 39, 46, 1),
        ev("aten::mm", 40, 45, 1),
        ev("cudaLaunchKernel", 41, 44, 1, False, 2),
        ev("aten::mm", 140, 145, 1),
        ev("cudaLaunchKernel", 141, 144, 1, False, 6),
    ]
    sites = prof_mod.idle_gap_sites(events, steps=2)
    assert sites == [
        ("/x/d9d/engine/step.py(10): run | aten::mm", pytest.approx(0.04), 1.0),
        ("add_c -> add_d", pytest.approx(0.015), 0.5),
    ]


def test_breakdown_of_cpu_ops(prof_mod) -> None:
    ev = prof_mod.Event
    events = [
        ev("aten::linear", 0, 50, 1),  # not a leaf: its addmm is the work
        ev("aten::addmm", 5, 45, 1),
        ev("c10d::allgather_", 60, 100, 1),  # a collective counts whole, its packing ops inside do not
        ev("aten::empty", 61, 62, 1),
        ev("gloo:all_gather", 70, 120, 2),  # gloo's thread
        ev("aten::copy_", 80, 90, 2),
        ev("aten::item", 130, 140, 1),  # of a CPU tensor: work, and no host sync
    ]
    report = prof_mod.breakdown_events(events, wall_s=200e-6, steps=1)
    assert report["source"] == "cpu ops"
    # compute [5,45] ∪ [130,140] = 50 µs; communication [60,120] = 60 µs, all exposed; idle 200 − 110
    assert report["busy_ms_per_step"] == pytest.approx(
        {"compute": 0.05, "communication": 0.06, "exposed communication": 0.06, "idle": 0.09}
    )
    assert report["ms_per_step"]["all-gather"] == pytest.approx(0.09)  # 40 + 50 µs: a sum, not a union
    assert report["ms_per_step"]["matmul"] == pytest.approx(0.04)
    assert report["ms_per_step"]["dtype copies"] == 0.0
    assert report["host_syncs"]["per_step"] == 0 and report["host_syncs"]["ms_per_step"] == 0


def test_profile_across_ranks(prof_mod) -> None:
    def report(rank, step, compute, exposed, a2a):
        return {
            "rank": rank,
            "source": "cuda kernels",
            "step_ms": step,
            "ms_per_step": {"all-to-all": a2a, "matmul": compute},
            "busy_ms_per_step": {
                "compute": compute,
                "communication": a2a,
                "exposed communication": exposed,
                "idle": step - compute - exposed,
            },
            "host_syncs": {"ms_per_step": 1.0, "per_step": 4.0, "by_site": {"aten::copy_": [4.0, 1.0]}},
        }

    # rank 1 computes the most; ranks 0 and 2 wait for it in the all-to-all
    ranks = [
        report(0, 100.0, 50.0, 30.0, 40.0),
        report(1, 100.0, 70.0, 10.0, 20.0),
        report(2, 101.0, 52, 29, 40),
    ]
    spread = prof_mod.across_ranks(ranks)
    assert spread["busy_ms_per_step"]["compute"] == pytest.approx(
        {"mean": 172 / 3, "max": 70.0, "max_rank": 1}
    )
    assert spread["busy_ms_per_step"]["exposed communication"]["max_rank"] == 0
    assert spread["step_ms"]["max_rank"] == 2 and spread["host_syncs"]["per_step"]["mean"] == 4.0
    text = prof_mod.render_ranks({"ranks": ranks, "across_ranks": spread, "slowest_rank_per_step": [1, 1]})
    assert "exposed communication" in text and "slowest rank per timed step: 1 1" in text
    assert "aten::copy_ 4.0x 1.00 ms" in text


def test_numa_binding_reaches_every_torchrun_row_and_no_ray_row(bench, tmp_path: Path) -> None:
    """`--numa-binding MODE` is torchrun's own flag, given to d9d's and torchtitan's torchrun rows alike (a
    fair comparison); `d9d train` on Ray is not launched by torchrun and is left as it is."""
    rows = {r.id: r for r in bench.all_rows(2, _args())}
    for row_id in ("dense-fsdp", "titan-dense-fsdp", "dense-fsdp@ray"):
        for binding in (None, "exclusive"):
            row_dir = Path(tempfile.mkdtemp(dir=tmp_path))
            cmd, _ = bench.row_command(rows[row_id], _args(numa_binding=binding), row_dir)
            torchrun = "torch.distributed.run" in cmd
            assert torchrun == (not row_id.endswith("@ray")), cmd
            bound = "--numa-binding" in cmd
            assert bound == (torchrun and binding is not None), cmd
            if bound:
                at = cmd.index("--numa-binding")
                assert cmd[at + 1] == binding and at < cmd.index("-m", at), cmd  # a torchrun option


def test_a_timed_out_row_keeps_its_own_last_lines_and_its_processes_stacks(bench, tmp_path: Path) -> None:
    """The tail of a stopped torchrun row ends before the launcher's shutdown noise; the row's processes are
    found by process group (a child in its own session here) and dumped, the launcher left out."""
    log = tmp_path / "output.log"
    log.write_text(
        "[rank0] step 12 done\n[rank0] entering dispatch\n"
        "W1128 elastic/multiprocessing/api.py:1012] Sending process 7 closing signal SIGTERM\n"
        "Traceback (most recent call last):\n  File run.py\nSignalException: got signal: 15\n"
    )
    assert bench.tail(log, 5, stopped=True) == ["[rank0] step 12 done", "[rank0] entering dispatch"]
    assert bench.tail(log, 1) == ["SignalException: got signal: 15"]  # exited on its own: the real end

    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "d9d.engine.launch"], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 10
        # until the child has exec'd its command (right after the fork its command line is not yet it)
        while (
            "time.sleep(60)" not in str(found := bench.group_processes(child.pid))
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert [pid for pid, _ in found] == [child.pid]
        assert "time.sleep(60)" in found[0][1]
        launcher = (child.pid + 1, "python -m torch.distributed.run --nproc-per-node 2 -m d9d.engine.launch")
        dumped: list[int] = []

        def dump(pid: int) -> str:
            dumped.append(pid)
            return 'Thread 1 (idle): "MainThread"\n    <module> (<string>:1)'

        stacks = bench.python_stacks([*found, launcher], dump)
        assert dumped == [child.pid]
        assert stacks[str(child.pid)][1:] == ['Thread 1 (idle): "MainThread"', "    <module> (<string>:1)"]
        assert bench.python_stacks(found, None) == {}
    finally:
        child.kill()
        child.wait()


class _StoppedRecorder:
    """A py-spy process that has already written its file and exited."""

    returncode = 0

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0


def test_a_py_spy_record_is_kept_gzipped_and_summarized_per_thread_and_by_step_frame(
    bench, tmp_path: Path
) -> None:
    """The raw stacks are tens of MB as text (more than one file may bring back from a device call), so the
    row keeps them gzipped and puts the step thread's commonest frames into its JSON."""
    import gzip

    step = "Trainer._run_step (d9d/engine/trainer.py:219)"
    lines = [
        f'process 11:"launch";thread (11): MainThread;{step};forward (step.py:70);mm (ops.py:5) 3',
        f'process 11:"launch";thread (11): MainThread;{step};exchange (all_to_all.py:9) 1',
        'process 11:"launch";thread (12): courier;send (report.py:4) 2',
    ]
    raw = tmp_path / "py-spy.txt"
    raw.write_text("\n".join(lines) + "\n")
    row = bench.Row("moe-fsdp-ep", "moe", "d9d", "torchrun", 2, "FSDP 2 × EP 2")
    out = tmp_path / "result.json"
    summary = bench.finish_recorder(_StoppedRecorder(), row, _args(out=str(out)), raw)
    kept = tmp_path / "result.moe-fsdp-ep.py-spy.txt.gz"
    assert gzip.decompress(kept.read_bytes()).decode() == raw.read_text()
    frames = summary["step_frames"]["process 11"]
    assert frames["samples"] == 4
    assert dict(frames["inclusive"])["forward (step.py)"] == 0.75
    threads = summary["processes"]["process 11"]
    assert threads["MainThread (11)"]["in_step"] == 4 and threads["courier (12)"]["in_step"] == 0
