"""What running under Ray actors costs compared with the engine's own bare-process launcher.

Runs the same job twice on the same machine, back to back:
  1. bare:  torchrun --standalone --nproc-per-node N -m d9d.engine.launch CONFIG   (the engine's launcher)
  2. ray:   d9d.cluster.TrainingJob on a fresh local Ray instance (rank actors + coordinator)
and prints the median step time of each (rank 0, after warm-up) and their ratio (target <= 1.03x),
the actor start-up time (start() -> ranks running, -> first step), the tracker lag (rank report ->
MLflow write, from the coordinator's `cluster/metrics_lag_s`), and, in a third run, the recovery time
after a rank actor is killed (kill -> first step completed by the restarted ranks).

    .venv/bin/python benchmarks/cluster_overhead.py                      # built-in tiny LM, dp2
    .venv/bin/python benchmarks/cluster_overhead.py --config examples/qwen3_moe_pretrain/tiny.yaml --nproc 4

Without --config the job is the engine tests' tiny LM (tests/engine_fixtures.py) on `--nproc` DP ranks; its
steps are milliseconds long, so the fixed per-step cost of the reporter calls is as visible as it can get.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def builtin_job(nproc: int, steps: int, width: int) -> dict:
    return {
        "run": {"name": "overhead"},
        "mesh": {"data_parallel_replicate": nproc},
        "batching": {"global_batch_size": 8 * nproc, "microbatch_size": 4},
        "trainer": {"total_steps": steps},
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider", "options": {"width": width}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "tests.engine_fixtures:TokenCETask"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-3}},
        "checkpointing": {"period": None, "save_at_end": False},
        "logging": {"progress_bar": "off"},
    }


def median_step(times: dict[int, float], warmup: int) -> float:
    kept = [t for step, t in sorted(times.items()) if step > warmup]
    return statistics.median(kept)


def run_bare(config: Path, nproc: int, overrides: list[str], run_dir: Path) -> dict[int, float]:
    sets = [
        a
        for o in [*overrides, f"run.dir={run_dir}", "logging.tracker={kind: log, stdout: false}"]
        for a in ("--set", o)
    ]
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "d9d.engine.launch", str(config), *sets]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"bare launcher failed:\n{out.stderr[-3000:]}")
    times = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():  # the engine's default log tracker
        record = json.loads(line)
        if record.get("event") == "scalars" and "step_time_s" in record["values"]:
            times[int(record["step"])] = float(record["values"]["step_time_s"])
    return times


def run_ray(config: Path, nproc: int, overrides: list[str], kill_at: int | None) -> dict[str, object]:
    from d9d.cluster import JobState, TrainingJob

    job = TrainingJob(config, overrides=overrides)
    started = time.perf_counter()
    job.start()
    running_at = first_step_at = killed_at = recovered_at = None
    killed_step = 0
    times: dict[int, float] = {}
    while True:
        points, ended = job.poll_metrics(0.05)
        now = time.perf_counter()
        status = job.status()
        if running_at is None and status.state is JobState.RUNNING:
            running_at = now
        for p in points:
            if p.kind != "train" or p.rank != 0:
                continue
            first_step_at = first_step_at or now
            times[p.step] = float(p.values["step_time_s"])
            # The restarted ranks resume from a checkpoint before `killed_step` and train it again.
            if killed_at is not None and recovered_at is None and p.step <= killed_step:
                recovered_at = now
            if kill_at is not None and killed_at is None and p.step >= kill_at:
                job.kill_rank(1)
                killed_at, killed_step = time.perf_counter(), p.step
        if ended:
            break
    summary = job.result()
    lag = []
    tracker_db = job.spec.run_dir / "mlflow.db"
    if tracker_db.exists():
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{tracker_db}")
        run = client.search_runs([client.get_experiment_by_name("d9d").experiment_id])[0]
        lag = [m.value for m in client.get_metric_history(run.info.run_id, "cluster/metrics_lag_s")]
    return {
        "times": times,
        "startup_running_s": (running_at or now) - started,
        "startup_first_step_s": (first_step_at or now) - started,
        "recovery_external_s": None
        if killed_at is None or recovered_at is None
        else recovered_at - killed_at,
        "recovery_summary_s": summary.recovery_times_s,
        "lag": lag,
        "status": summary.status,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, help="job file (default: a built-in tiny LM job)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=256, help="tiny LM width (built-in job only)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))

    from d9d.cluster import connect, disconnect

    tmp = Path(tempfile.mkdtemp(prefix="d9d-overhead-"))
    config = args.config
    if config is None:
        config = tmp / "job.yaml"
        config.write_text(yaml.safe_dump(builtin_job(args.nproc, args.steps, args.width)))
    common = [*args.overrides, f"trainer.total_steps={args.steps}", "checkpointing.period=null"]

    bare = run_bare(config, args.nproc, common, tmp / "bare")
    os.environ["OMP_NUM_THREADS"] = "1"  # Ray sets it to the actor's CPUs; the bare run above used 1
    connect(local_cpus=args.nproc + 1)
    plain = run_ray(config, args.nproc, [*common, f"run.dir={tmp / 'ray'}", "run.name=overhead-ray"], None)
    period = max(2, args.steps // 6)
    assert (args.steps // 2 + 1) % period != 0
    faulty = run_ray(
        config,
        args.nproc,
        [*common, f"run.dir={tmp / 'kill'}", "run.name=overhead-kill", f"checkpointing.period={period}"],
        kill_at=args.steps // 2 + 1,  # not a checkpoint step: the restart must recompute it
    )
    disconnect()

    bare_step = median_step(bare, args.warmup)
    ray_step = median_step(plain["times"], args.warmup)  # type: ignore[arg-type]
    print(f"job: {config} on {args.nproc} ranks, {args.steps} steps (median over steps > {args.warmup})")
    ratio = ray_step / bare_step
    print(f"step time   bare {bare_step * 1e3:.3f} ms, ray {ray_step * 1e3:.3f} ms, ray/bare {ratio:.3f}x")
    print(
        f"start-up    start() -> ranks running {plain['startup_running_s']:.2f} s, "
        f"-> first step {plain['startup_first_step_s']:.2f} s"
    )
    lag: list[float] = plain["lag"]  # type: ignore[assignment]
    if lag:
        median_ms, max_ms = statistics.median(lag) * 1e3, max(lag) * 1e3
        print(f"tracker lag rank report -> MLflow write: median {median_ms:.1f} ms, max {max_ms:.1f} ms")
    external = faulty["recovery_external_s"]
    print(
        f"recovery    kill -> first step after restart {external} s (measured here), "
        f"{faulty['recovery_summary_s']} s (coordinator: detection -> first step), status {faulty['status']}"
    )


if __name__ == "__main__":
    main()
