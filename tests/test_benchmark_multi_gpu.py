"""`benchmarks/multi_gpu.py`: its smoke mode end to end on 2 gloo ranks, every GPU row's job valid at 2 and 4
GPUs, and the table's arithmetic (ratios, bubble) on made-up records. No number is checked for speed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.engine_fixtures import subprocess_env

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import multi_gpu

        yield multi_gpu
    finally:
        sys.path.remove(str(BENCH))


def _args(**overrides):
    args = {
        "smoke": False,
        "cp_seq": 8192,
        "pp_microbatch": 2,
        "ray_rows": "*",
        "rows": "*",
        "launchers": "torchrun,ray",
        "warmup": 3,
        "steps": 10,
        "cpus_per_rank": 4,
        "set": [],
        "variant": [],
    }
    return argparse.Namespace(**{**args, **overrides})


@pytest.mark.distributed
def test_smoke_runs_rows_on_two_gloo_ranks(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [
        sys.executable,
        str(BENCH / "multi_gpu.py"),
        "--smoke",
        "--rows",
        "dense-1gpu,dense-fsdp,dense-pp-1f1b",
    ]
    cmd += ["--launchers", "torchrun", "--out", str(out), "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(
        cmd, env=subprocess_env(GLOO_SOCKET_IFNAME="lo"), capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["gpus"] == 2 and report["torch"]
    rows = {r["id"]: r for r in report["results"]}
    assert list(rows) == ["dense-1gpu", "dense-fsdp", "dense-pp-1f1b"], rows.keys()
    for row in rows.values():
        assert "error" not in row, (row["id"], row.get("error"), row.get("log_tail"))
        for key in ("tokens_per_s", "tokens_per_s_per_gpu", "median_step_s", "mfu", "peak_gib", "scaling"):
            assert key in row, (row["id"], key)
        assert row["tokens_per_s"] > 0 and len(row["step_s"]) == 2  # --smoke: 2 timed steps
    assert rows["dense-fsdp"]["tokens_per_s_per_gpu"] == pytest.approx(rows["dense-fsdp"]["tokens_per_s"] / 2)
    assert rows["dense-1gpu"]["scaling"] == pytest.approx(1.0)
    bubble = rows["dense-pp-1f1b"]["pipeline"]
    assert bubble["microbatches"] == 8
    assert 0.0 <= bubble["bubble_measured"] < 1.0
    assert bubble["bubble_sim_unit"] == pytest.approx(1 / 9)  # 1F1B: (p - 1) / (m + p - 1)
    assert set(bubble["pass_median_s"]) == {"0F", "0B", "1F", "1B"}
    assert "| dense-pp-1f1b |" in proc.stdout  # the markdown table


def test_every_gpu_row_is_a_valid_job(bench, tmp_path: Path) -> None:
    from d9d.cluster.spec import build_job
    from d9d.core.mesh_params import DeviceMeshParameters
    from d9d.engine.config import parse_config

    for n in (2, 4):
        rows = bench.all_rows(n, _args())
        ids = {r.id for r in rows}
        assert {"dense-fsdp@ray", "moe-pp-zbv", "titan-moe-fsdp-ep", "dense-pp-dualpipev"} <= ids
        for row in rows:
            assert DeviceMeshParameters(**row.mesh).world_size == row.gpus, row
            assert bench.global_batch(row, smoke=False) * row.seq == 8 * 2048 * row.gpus, row
            if row.framework != "d9d":
                continue
            job = bench.d9d_job(row, _args(), Path(tempfile.mkdtemp(dir=tmp_path)))
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


def test_bubble_from_records(bench) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from throughput.bubble import pipeline_bubble
    finally:
        sys.path.remove(str(BENCH))

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
    assert uneven["bubble_measured"] == pytest.approx(((1 - 12 / 20) + (1 - 20 / 20)) / 2)
    assert uneven["bubble_sim"] > 0.2 and uneven["bubble_sim_unit"] == pytest.approx(0.2)


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
