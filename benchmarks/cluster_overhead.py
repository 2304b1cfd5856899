"""What running under Ray actors costs compared with the engine's own bare-process launcher.

Runs the same job on the same machine, back to back, `--repeats` times:
  1. bare:  torchrun --standalone --nproc-per-node N -m d9d.engine.launch CONFIG   (the engine's launcher)
  2. bare again while an idle local Ray instance is up (what Ray's own daemons cost this machine)
  3. ray:   d9d.cluster.TrainingJob on that Ray instance (rank actors + coordinator)
  4. (last repeat) ray again, killing rank 1 halfway, for start-up, failure detection and recovery
and prints, after warm-up:
  - step time: median of the engine's `step_time_s` (forward/backward/optimizer of rank 0),
  - wall per step: median interval between consecutive steps' reports, which also holds every per-step
    cost outside the step (reporting, command polling, CPU taken by the coordinator and Ray),
  - both against the bare run (target <= 1.03x) and against the bare run beside an idle Ray (the actor
    layer alone),
  - start-up (start() -> ranks running, -> first step), tracker lag (rank report -> tracker write, the
    coordinator's `system/cluster/metrics_lag_s`), failure detection (kill -> the coordinator leaves
    `running`, target < 3 s) and recovery (kill -> first step completed by the restarted ranks).
Both launchers log to the same tracker (`--tracker`, default the cheap `log` JSON-lines tracker).

    .venv/bin/python benchmarks/cluster_overhead.py                      # built-in tiny LM, dp2
    .venv/bin/python benchmarks/cluster_overhead.py --config examples/qwen3_moe_pretrain/tiny.yaml --nproc 4
    python benchmarks/cluster_overhead.py --model qwen3 --nproc 2 --steps 30   # GPUs: Qwen3-0.6B shape, dp2

Without --config the job is the engine tests' tiny LM (tests/engine_fixtures.py) on `--nproc` DP ranks; its
steps take milliseconds, so any fixed per-step cost is as visible as it can get. On a machine with fewer
cores than ranks + 1, the coordinator and Ray's own processes compete with the ranks for CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from d9d.cluster import TrainingJob

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


def qwen3_job(nproc: int, steps: int) -> dict:
    """GPU: the Qwen3-0.6B shape of `train_throughput.py` (bf16, batch 8 x 2048 random tokens per rank)."""
    from benchmarks.throughput.common import BATCH, DENSE, SEQ

    return {
        "run": {"name": "overhead"},
        "mesh": {"data_parallel_replicate": nproc},
        "batching": {"global_batch_size": BATCH * nproc, "microbatch_size": BATCH},
        "trainer": {"total_steps": steps},
        "model": {
            "provider": "qwen3",
            "options": {"architecture": {**DENSE, "max_position_embeddings": SEQ}, "dtype": "bfloat16"},
        },
        "data": {
            "provider": "benchmarks.throughput.data:RandomTokens",
            "options": {"vocab_size": DENSE["vocab_size"], "seq_len": SEQ},
        },
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-4}},
        "checkpointing": {"period": None, "save_at_end": False},
        "logging": {"progress_bar": "off"},
        "cluster": {"resources": {"cpus": 4, "gpus": 1}},
    }


def medians(steps: dict[int, tuple[float, float]], warmup: int) -> tuple[float, float]:
    """(median step_time_s, median wall interval between consecutive steps) over steps after warm-up."""
    kept = sorted((s, v) for s, v in steps.items() if s > warmup)
    compute = statistics.median(v[0] for _, v in kept)
    wall = statistics.median(b[1] - a[1] for (sa, a), (sb, b) in itertools.pairwise(kept) if sb == sa + 1)
    return compute, wall


def read_log_tracker(run_dir: Path) -> tuple[dict[int, tuple[float, float]], list[float]]:
    """Step -> (step_time_s, wall time) and the `system/cluster/metrics_lag_s` values from a log tracker's
    file."""
    steps, lag = {}, []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") != "scalars":
            continue
        values = record["values"]
        if "train/step_time_s" in values and "train/loss" in values:
            steps[int(record["step"])] = (float(values["train/step_time_s"]), float(record["time"]))
        if "system/cluster/metrics_lag_s" in values:
            lag.append(float(values["system/cluster/metrics_lag_s"]))
    return steps, lag


def run_bare(config: Path, nproc: int, overrides: list[str]) -> dict[int, tuple[float, float]]:
    from tests.engine_fixtures import torchrun_command

    cmd = torchrun_command(config, *overrides, nproc=nproc)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"bare launcher failed:\n{out.stderr[-3000:]}")
    run_dir = Path(next(o for o in overrides if o.startswith("run.dir=")).partition("=")[2])
    return read_log_tracker(run_dir)[0]


def run_ray(config: Path, overrides: list[str]) -> tuple[dict[int, tuple[float, float]], list[float]]:
    """Nobody watches: the driver waits for the end in one call."""
    from d9d.cluster import TrainingJob

    job = TrainingJob(config, overrides=overrides).start()
    job.result()
    steps = {
        p.step: (float(p.values["step_time_s"]), p.wall_time)
        for p in job.metrics()
        if p.kind == "train" and p.rank == 0
    }
    log_file = job.spec.run_dir / "metrics.jsonl"
    return steps, read_log_tracker(job.spec.run_dir)[1] if log_file.exists() else []


def watch_fault(job: TrainingJob, fault_at: int, inject: Callable[[TrainingJob], None]) -> dict[str, object]:
    """Start-up, failure detection and recovery, watched from the driver: `job` is started, and `inject`
    causes the fault once step `fault_at` is reported (the clock starts when it returns)."""
    from d9d.cluster import JobState

    started = time.perf_counter()
    job.start()
    running_at = first_step_at = fault_done = detected_at = recovered_at = None
    detected_wall = 0.0
    while True:
        points, ended = job.poll_metrics(0.02 if fault_done is not None and detected_at is None else 0.2)
        now = time.perf_counter()
        state = job.status().state
        if running_at is None and state is JobState.RUNNING:
            running_at = now
        if fault_done is not None and detected_at is None and state is not JobState.RUNNING:
            detected_at, detected_wall = now, time.time()
        for p in points:
            if p.kind != "train" or p.rank != 0:
                continue
            first_step_at = first_step_at or now
            # Once a rank is gone the old ranks finish no step, so a step reported after detection is the
            # restarted ranks' (points already on their way when it failed carry earlier times).
            if detected_at is not None and recovered_at is None and p.wall_time > detected_wall:
                recovered_at = now
            if fault_done is None and p.step >= fault_at:
                inject(job)
                fault_done = time.perf_counter()
        if ended:
            break
    summary = job.result()
    return {
        "startup_running_s": (running_at or now) - started,
        "startup_first_step_s": (first_step_at or now) - started,
        "detection_s": None if fault_done is None or detected_at is None else detected_at - fault_done,
        "recovery_external_s": None
        if fault_done is None or recovered_at is None
        else recovered_at - fault_done,
        "recovery_summary_s": [round(r, 2) for r in summary.recovery_times_s],
        "world_sizes": summary.world_sizes,
        "status": summary.status,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, help="job file (default: a built-in tiny LM job)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--model", choices=["tiny", "qwen3"], default="tiny", help="built-in job (qwen3: one GPU per rank)"
    )
    parser.add_argument("--width", type=int, default=256, help="tiny LM width (built-in job only)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each launcher, interleaved")
    parser.add_argument(
        "--tracker", default="log", choices=["log", "mlflow", "null"], help="for both launchers"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from d9d.cluster import TrainingJob, connect, disconnect

    tmp = Path(tempfile.mkdtemp(prefix="d9d-overhead-"))
    config = args.config
    if config is None:
        config = tmp / "job.yaml"
        job = (
            qwen3_job(args.nproc, args.steps)
            if args.model == "qwen3"
            else builtin_job(args.nproc, args.steps, args.width)
        )
        config.write_text(yaml.safe_dump(job))
    cpus = int(yaml.safe_load(config.read_text()).get("cluster", {}).get("resources", {}).get("cpus", 1))
    # Ray gives an actor as many OpenMP threads as it reserved CPUs; the bare ranks get the same.
    os.environ["OMP_NUM_THREADS"] = str(cpus)
    tracker = {"log": '{kind: "log", stdout: false}', "mlflow": '{kind: "mlflow"}', "null": '{kind: "null"}'}
    common = [
        *args.overrides,
        f"trainer.total_steps={args.steps}",
        "checkpointing.period=null",
        "logging.period=1",  # every step is reported (and timed)
        f"logging.tracker={tracker[args.tracker]}",
    ]

    # Machines like CI's are noisy: every repeat runs the three launchers back to back (Ray started for the
    # repeat and stopped after it, so the first run is truly without Ray), and every row is the median over
    # repeats of each run's median (with the run medians, for the spread).
    runs: dict[str, list[tuple[float, float]]] = {"bare": [], "bare, Ray idle": [], "ray": []}
    lag: list[float] = []
    faulty: dict[str, object] = {}
    victim = min(1, args.nproc - 1)  # the rank the last repeat kills
    for i in range(args.repeats):
        bare = run_bare(config, args.nproc, [*common, f"run.dir={tmp / f'bare-{i}'}"])
        runs["bare"].append(medians(bare, args.warmup))
        connect(local_cpus=args.nproc * cpus + 1)
        # The same bare run while an idle Ray instance is up: what Ray's own daemons cost on this machine.
        bare_idle = run_bare(config, args.nproc, [*common, f"run.dir={tmp / f'bare-ray-idle-{i}'}"])
        runs["bare, Ray idle"].append(medians(bare_idle, args.warmup))
        ray_steps, ray_lag = run_ray(
            config, [*common, f"run.dir={tmp / f'ray-{i}'}", f"run.name=overhead-{i}"]
        )
        runs["ray"].append(medians(ray_steps, args.warmup))
        lag += ray_lag
        if i == args.repeats - 1:
            period = max(2, args.steps // 6)
            kill_at = args.steps // 2 + 1 if (args.steps // 2 + 1) % period else args.steps // 2 + 2
            overrides = [
                *common,
                f"run.dir={tmp / 'kill'}",
                "run.name=overhead-kill",
                f"checkpointing.period={period}",
            ]
            faulty = watch_fault(
                TrainingJob(config, overrides=overrides),
                kill_at,  # not a checkpoint step: the restart must recompute it
                lambda job: job.kill_rank(victim),
            )
        disconnect()

    rows = {
        name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
        for name, rs in runs.items()
    }
    print(
        f"job: {config} on {args.nproc} ranks, {args.steps} steps x {args.repeats} runs, "
        f"tracker {args.tracker}"
    )
    print(
        f"{'':16s}{'step time':>12s}{'wall/step':>12s}{'step ratio':>12s}{'wall ratio':>12s}"
        "  run medians (ms)"
    )
    base_step, base_wall = rows["bare"]
    for name, (step, wall) in rows.items():
        ratios = f"{step / base_step:11.3f}x{wall / base_wall:11.3f}x"
        spread = ", ".join(f"{r[1] * 1e3:.2f}" for r in runs[name])
        print(f"{name:16s}{step * 1e3:10.3f}ms{wall * 1e3:10.3f}ms{ratios}  wall [{spread}]")
    idle_step, idle_wall = rows["bare, Ray idle"]
    ray_step, ray_wall = rows["ray"]
    layer = f"{ray_step / idle_step:.3f}x step, {ray_wall / idle_wall:.3f}x wall"
    print(f"ray vs bare beside an idle Ray (the actor layer alone): {layer}")
    print(
        f"start-up       start() -> ranks running {faulty['startup_running_s']:.2f} s, "
        f"-> first step {faulty['startup_first_step_s']:.2f} s"
    )
    if lag:
        print(f"tracker lag    median {statistics.median(lag) * 1e3:.1f} ms, max {max(lag) * 1e3:.1f} ms")

    def seconds(value: object) -> str:
        return f"{value:.2f} s" if isinstance(value, float) else "n/a (the job ended before the kill)"

    print(f"detection      kill -> coordinator leaves `running` {seconds(faulty['detection_s'])}")
    print(
        f"recovery       kill -> first step after restart {seconds(faulty['recovery_external_s'])} (here), "
        f"{faulty['recovery_summary_s']} s (coordinator: detection -> first step), status {faulty['status']}"
    )


if __name__ == "__main__":
    main()
