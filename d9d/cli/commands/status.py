"""`d9d status RUN`: the run's Ray job, its actors and its latest progress line; or, for a local run with no
Ray job, its run_summary.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from d9d.cluster import submit as jobs
    from d9d.cluster.follow import PREFIX

    address = jobs.dashboard_address(args.address)
    try:
        sub = jobs.find(args.run, address)
    except Exception as e:  # no dashboard there, or no such job: fall back to the run directory
        summary = (args.run_dir or Path("runs") / args.run) / "run_summary.json"
        if summary.is_file():
            print(json.dumps(json.loads(summary.read_text()), indent=1))
            return 0
        print(f"d9d status: {e}", file=sys.stderr)
        return 1
    print(f"run {sub.run_name}: Ray job {sub.submission_id} {sub.status} {sub.message}".rstrip())
    for name, state in jobs.rank_actors(sub.run_name, address):
        print(f"  {name}: {state}")
    progress = [
        line for line in jobs.logs(sub.submission_id, address).splitlines() if line.startswith(PREFIX)
    ]
    if progress:
        print(f"  last: {progress[-1]}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("status", help="state of a run submitted to a Ray cluster")
    parser.add_argument("run", help="run name (or a submission id)")
    parser.add_argument("--address", help="dashboard address (default: RAY_ADDRESS or http://127.0.0.1:8265)")
    parser.add_argument("--run-dir", type=Path, help="local run directory (default: runs/RUN)")
    parser.set_defaults(handler=_run)
