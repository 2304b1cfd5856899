"""`d9d train CONFIG`: run a job on Ray rank actors and follow it until it ends.

Without --address or RAY_ADDRESS a local Ray instance is started (the laptop default); inside a Ray job
(`d9d submit`) RAY_ADDRESS points at the cluster. The whole config is validated before Ray is touched.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def run(args: argparse.Namespace) -> int:
    from d9d.cluster import TrainingJob, load_job
    from d9d.cluster.checkpoints import RunFinished
    from d9d.cluster.follow import follow
    from d9d.engine.checkpoint import CheckpointError
    from d9d.engine.config import ConfigError

    overrides = list(args.overrides)
    if args.resume_from is not None:
        overrides.append(f"run.resume_from={args.resume_from}")
    try:
        spec = load_job(args.config, overrides, num_workers=args.num_workers, cpu=args.cpu)
    except (ConfigError, ValueError) as e:
        print(f"d9d train: {e}", file=sys.stderr)
        return 2
    if args.detach:
        spec = type(spec)(cluster=spec.cluster.model_copy(update={"detach": True}), train=spec.train)
    if args.verbose:
        spec = type(spec)(
            cluster=spec.cluster.model_copy(update={"rank_output": "forward"}), train=spec.train
        )
    try:
        job = TrainingJob(spec).start(address=args.address)
    except RunFinished as e:
        print(f"d9d train: {e}", file=sys.stderr)
        return 0
    except (CheckpointError, ValueError) as e:  # resume refused: identity, run.resume, damaged commits
        print(f"d9d train: {e}", file=sys.stderr)
        return 2
    if spec.cluster.detach:
        print(f"run {spec.run_name} started (detached); follow it with TrainingJob.attach({spec.run_name!r})")
        return 0
    # `ray job stop` sends SIGTERM: stop the ranks at once and write the summary before Ray's SIGKILL.
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        summary = follow(job)
    except (KeyboardInterrupt, _Terminated):
        print(f"d9d train: stopping run {spec.run_name}", file=sys.stderr, flush=True)
        job.stop(force=True)
        summary = job.result(timeout=30)
    return 1 if summary.status == "failed" else 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("train", help="train on Ray rank actors (local Ray unless --address)")
    parser.add_argument("config", type=Path, help="job file: the engine config plus a `cluster:` section")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else a local instance)")
    parser.add_argument("--num-workers", type=int, help="rank actors; changes the data-parallel degree")
    parser.add_argument(
        "--cpu", action="store_true", help="CPU ranks on gloo even if the config asks for GPUs"
    )
    parser.add_argument(
        "--detach", action="store_true", help="return once started; the run outlives this process"
    )
    parser.add_argument(
        "--resume-from",
        type=Path,
        metavar="PATH",
        help="a committed step directory to start this run from (same run identity; see docs/engine.md)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="forward every rank's output to this console (default: <run dir>/logs/rank<r>.log)",
    )
    parser.set_defaults(handler=run)
