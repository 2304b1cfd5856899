"""`d9d resume RUN`: continue a run whose coordinator died before the run ended (its process was killed,
its node or the Ray head was lost, a non-detached driver went away with it).

The run's journal (`<run dir>/coordinator.json`, written by every coordinator) holds the job as it ran; a
new coordinator starts from it, continues the attempt numbering and the commit history, and the ranks
resume from the newest verified commit. RUN is a run directory or a run name under `runs/`. The run is
followed to its end, as by `d9d train`, unless `--detach`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from d9d.cli import exit_codes
    from d9d.cli import main as cli
    from d9d.cli.commands.train import follow_preemptible
    from d9d.cluster import TrainingJob
    from d9d.cluster.checkpoints import RunFinished
    from d9d.cluster.client import started_from_process
    from d9d.cluster.follow import follow
    from d9d.cluster.lease import LeaseHeld
    from d9d.engine.checkpoint import CheckpointError

    started_from_process(cli.invoked_at)  # the start-up phases count from this command's start

    run: str | Path = args.run_dir or args.run
    try:
        job = TrainingJob.resume_run(run, args.address, detach=True if args.detach else None)
    except RunFinished as e:
        print(f"d9d resume: {e}", file=sys.stderr)
        return exit_codes.ALREADY_FINISHED
    except LeaseHeld as e:  # its coordinator lives (another `d9d resume`, or it did not die)
        print(f"d9d resume: {e}", file=sys.stderr)
        return exit_codes.LIVE_LAUNCH
    except (CheckpointError, RuntimeError, ValueError) as e:
        print(f"d9d resume: {e}", file=sys.stderr)
        return 2
    name = job.run_name
    if args.detach:
        print(f"run {name} resumed (detached); follow it with TrainingJob.attach({name!r})")
        return 0
    # Followed here even when the run is detached (`cluster.detach` from its journal): its coordinator
    # then outlives this command, as it outlived the driver that started it.
    print(f"run {name} resumed", flush=True)
    if job.spec.cluster.detach:
        try:
            return exit_codes.of_run(job, follow(job))
        except KeyboardInterrupt:
            print(f"d9d resume: no longer following run {name}; it goes on", file=sys.stderr)
            return exit_codes.FINISHED
    return follow_preemptible(job, "resume")  # as `d9d train`: a signal saves the step and stops


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "resume", help="continue a run whose coordinator died, from the journal in its run directory"
    )
    parser.add_argument("run", help="run name (its directory is runs/RUN unless --run-dir) or run directory")
    parser.add_argument(
        "--run-dir", type=Path, help="the run directory (default: RUN if it is one, else runs/RUN)"
    )
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else a local instance)")
    parser.add_argument(
        "--detach",
        action="store_true",
        help="return once resumed (the coordinator becomes detached: the run outlives this process)",
    )
    parser.set_defaults(handler=_run)
