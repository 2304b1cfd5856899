"""`d9d stop RUN`: stop a run found by its name and wait until it ended: its Ray job (`ray job stop`: the
driver kills the ranks and writes the summary), else its live coordinator (ranks killed at once, as
`ray job stop` does)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

_STOP_WAIT_S = 120.0


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.storage import lookup_run
    from d9d.cluster import submit as jobs
    from d9d.cluster.lookup import attach

    lookup = lookup_run(args, "stop")
    if lookup is None:
        return 2
    run, loc = lookup.run, lookup.found
    if loc.submission is not None:
        sub, address = loc.submission, jobs.dashboard_address(args.address)
        print(f"run {sub.run_name}: Ray job {sub.submission_id} {jobs.stop(sub.submission_id, address)}")
        return 0
    job = attach(loc)
    if job is None:
        where = "it has ended" if loc.ended else "no Ray job or live coordinator found"
        print(f"d9d stop: run {run!r}: {where}", file=sys.stderr)
        return 1
    job.stop(force=True)
    summary = job.result(timeout=_STOP_WAIT_S)
    print(f"run {run}: {summary.status} after {summary.steps} steps")
    return 0


def register(subparsers: Any) -> None:
    from d9d.cli.commands.status import add_lookup_options

    parser = subparsers.add_parser("stop", help="stop a run, found by its name")
    add_lookup_options(parser)
    parser.set_defaults(handler=_run)
