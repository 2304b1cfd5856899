"""Recovery time with and without a warm standby rank (`cluster.standby_ranks`), and where it goes.

Each repeat runs the same job once per `--standby` count (default 0, 1 and the world size), each on a fresh
local Ray instance, kills rank 1 (rank 0 of a 1-rank job) at step `--kill-at` (with standbys: once they
reported ready, so the restart can use them) and measures, as cluster_overhead.py's `watch_fault` does:

  - recovery: kill -> the first step completed by the restarted ranks (watched from the driver), and the
    coordinator's own figure (detection -> first step, `run_summary.json`'s `recovery_times_s`);
  - the phase split of that recovery (`recovery_phases_s`: teardown, backoff, place, start, init process
    group, build, load, first step; see d9d/cluster/control/recovery.py), median over repeats.

    .venv/bin/python benchmarks/recovery.py                           # built-in tiny LM, dp2, CPU
    .venv/bin/python benchmarks/recovery.py --nproc 1 --model qwen3   # GPU: the 0.6B shape on 1 GPU

The job is cluster_overhead.py's built-in one (the real engine, `d9d.engine.launch:run_rank`), with a
checkpoint every `--period` steps and `cluster.restart_backoff_s: 0` (the backoff is policy, not cost).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from d9d.cluster import TrainingJob

REPO = Path(__file__).resolve().parents[1]


def wait_for_standby(job: TrainingJob, count: int, timeout_s: float = 300.0) -> None:
    """Block until the coordinator has `count` ready standbys (its status, not a metric point: the fault
    watcher may have consumed that point already)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = job.status()
        if status.standby_ready >= count:
            return
        if status.state.terminal:
            raise RuntimeError(f"run {job.run_name} ended before its standby was ready")
        time.sleep(0.2)
    raise TimeoutError(f"no standby of run {job.run_name} became ready within {timeout_s} s")


def one_run(
    config: Path, tmp: Path, name: str, standby: int, kill_at: int, period: int, victim: int
) -> dict[str, Any]:
    from benchmarks.cluster_overhead import watch_fault
    from d9d.cluster import TrainingJob

    overrides = [
        f"run.dir={tmp / name}",
        f"run.name={name}",
        f"checkpointing.period={period}",
        "checkpointing.keep_last=1",  # a 0.6B step is ~7 GB: repeats must not fill the disk
        f"cluster.standby_ranks={standby}",
        "cluster.restart_backoff_s=0",
        'logging.tracker={kind: "null"}',
    ]

    def kill(job: TrainingJob) -> None:
        if standby:
            waited = time.monotonic()
            wait_for_standby(job, standby)
            print(f"  standby ready {time.monotonic() - waited:.1f} s after step {kill_at}", flush=True)
        job.kill_rank(victim)

    result = watch_fault(TrainingJob(config, overrides=overrides), kill_at, kill)
    record = json.loads((tmp / name / "run_summary.json").read_text())
    result["phases"] = record["recovery_phases_s"]
    result["standby_ranks_used"] = record["standby_ranks_used"]
    shutil.rmtree(tmp / name, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--period", type=int, default=20, help="checkpoint period (steps)")
    parser.add_argument("--kill-at", type=int, default=30, help="kill once this step is reported")
    parser.add_argument("--model", choices=["tiny", "qwen3"], default="tiny")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--standby", type=int, nargs="+", help="cluster.standby_ranks values (default: 0, 1, --nproc)"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks.cluster_overhead import builtin_job, qwen3_job
    from d9d.cluster import connect, disconnect
    from d9d.cluster.control.recovery import PHASES

    tmp = Path(tempfile.mkdtemp(prefix="d9d-recovery-"))
    job = (
        qwen3_job(args.nproc, args.steps)
        if args.model == "qwen3"
        else builtin_job(args.nproc, args.steps, args.width)
    )
    # A stopped run ends the benchmark early: the kill must come before the last step.
    job["trainer"]["total_steps"] = args.steps
    config = tmp / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    cpus = int(job.get("cluster", {}).get("resources", {}).get("cpus", 1))

    counts = sorted(set(args.standby or [0, 1, args.nproc]))
    results: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    for i in range(args.repeats):
        for standby in counts:
            # One rank's CPUs more for the standby, one for the coordinator.
            connect(local_cpus=(args.nproc + standby) * cpus + 1)
            try:
                name = f"recovery-{standby}-{i}"
                r = one_run(config, tmp, name, standby, args.kill_at, args.period, min(1, args.nproc - 1))
            finally:
                disconnect()
            results[standby].append(r)
            print(
                f"repeat {i} standby_ranks={standby}: recovery {r['recovery_external_s']} s (driver), "
                f"{r['recovery_summary_s']} s (coordinator), standby ranks used {r['standby_ranks_used']}, "
                f"status {r['status']}",
                flush=True,
            )
            print("  phases:", {k: round(v, 2) for k, v in r["phases"][0].items()} if r["phases"] else None)

    print(f"\njob: built-in {args.model} on {args.nproc} ranks, {args.repeats} repeats (medians)")
    print(f"{'':28s}" + "".join(f"{f'standby {n}':>12s}" for n in counts))

    def row(label: str, values: dict[int, list[float]]) -> None:
        cells = "".join(
            f"{statistics.median(values[s]):11.2f}s" if values[s] else f"{'n/a':>12s}" for s in counts
        )
        print(f"{label:28s}{cells}")

    row(
        "kill -> first step (driver)",
        {s: [r["recovery_external_s"] for r in rs if r["recovery_external_s"]] for s, rs in results.items()},
    )
    row(
        "detection -> first step",
        {s: [r["recovery_summary_s"][0] for r in rs if r["recovery_summary_s"]] for s, rs in results.items()},
    )
    for phase in ("detect", *PHASES):
        row(
            f"  {phase}", {s: [r["phases"][0][phase] for r in rs if r["phases"]] for s, rs in results.items()}
        )


if __name__ == "__main__":
    main()
