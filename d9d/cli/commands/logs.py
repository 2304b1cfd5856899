"""`d9d logs RUN`: the driver log of the run's latest Ray job (rank output is forwarded into it)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from d9d.cluster import submit as jobs

    address = jobs.dashboard_address(args.address)
    try:
        sub = jobs.find(args.run, address)
    except Exception as e:
        print(f"d9d logs: {e}", file=sys.stderr)
        return 1
    shown = 0
    while True:
        text = jobs.logs(sub.submission_id, address)
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown = len(text)
        if not args.follow or jobs.find(sub.submission_id, address).status in (
            "SUCCEEDED",
            "FAILED",
            "STOPPED",
        ):
            return 0
        time.sleep(1.0)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("logs", help="logs of a run submitted to a Ray cluster")
    parser.add_argument("run", help="run name (or a submission id)")
    parser.add_argument("--address", help="dashboard address (default: RAY_ADDRESS or http://127.0.0.1:8265)")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    parser.set_defaults(handler=_run)
