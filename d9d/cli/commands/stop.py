"""`d9d stop RUN`: stop the run's latest Ray job (its rank actors go with it) and wait until it ended."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from d9d.cluster import submit as jobs

    address = jobs.dashboard_address(args.address)
    try:
        sub = jobs.find(args.run, address)
    except Exception as e:
        print(f"d9d stop: {e}", file=sys.stderr)
        return 1
    print(f"run {sub.run_name}: Ray job {sub.submission_id} {jobs.stop(sub.submission_id, address)}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("stop", help="stop a run submitted to a Ray cluster")
    parser.add_argument("run", help="run name (or a submission id)")
    parser.add_argument("--address", help="dashboard address (default: RAY_ADDRESS or http://127.0.0.1:8265)")
    parser.set_defaults(handler=_run)
