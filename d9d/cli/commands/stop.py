"""`d9d stop RUN`: stop a run found by its name and wait until it ended: its Ray job (`ray job stop`: the
driver, `d9d train`, gets SIGTERM and stops the ranks as below within `cluster.preemption_grace_s`), else its
live coordinator: the ranks stop at the next step boundary and commit that step (killed if they have not
within `--timeout`); `--now` kills them at once, losing the steps since the last commit."""

from __future__ import annotations

import argparse
import sys
from typing import Any

_STOP_WAIT_S = 120.0


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.storage import lookup_run, not_found
    from d9d.cluster.lookup import attach

    lookup = lookup_run(args, "stop")
    if lookup is None:
        return 2
    run, loc = lookup.run, lookup.found
    if loc.submission is not None:
        from d9d.cluster import submit as jobs

        sub, address = loc.submission, jobs.dashboard_address(args.address)
        if not args.now and loc.ray_address is not None:
            # `ray job stop` gives the driver only a few seconds (RAY_JOB_STOP_WAIT_TIME_S) after its
            # SIGTERM: have the coordinator commit the step the ranks are at first, when it is reachable.
            try:
                job = attach(loc)
                if job is not None:
                    summary = job.checkpoint_and_stop(args.timeout, reason="d9d stop")
                    print(f"run {sub.run_name}: {summary.status} after {summary.steps} steps")
            except Exception as e:  # the Ray job stop below still ends it
                print(f"d9d stop: could not stop run {run!r} at a step boundary: {e}", file=sys.stderr)
        print(f"run {sub.run_name}: Ray job {sub.submission_id} {jobs.stop(sub.submission_id, address)}")
        return 0
    job = attach(loc)
    if job is None:
        where = "it has ended" if loc.ended else "no Ray job or live coordinator found"
        if loc.record is None:
            where += f", and {not_found(lookup)}"
        print(f"d9d stop: run {run!r}: {where}", file=sys.stderr)
        return 1
    if args.now:
        job.stop(force=True, reason="d9d stop --now")
        summary = job.result(timeout=_STOP_WAIT_S)
    else:
        print(f"run {run}: stopping at the next step boundary, which is saved", flush=True)
        summary = job.checkpoint_and_stop(args.timeout, reason="d9d stop")
    latest = (
        f"; latest commit: step {job.status().latest_checkpoint_step}" if not job.coordinator_lost else ""
    )
    print(f"run {run}: {summary.status} after {summary.steps} steps{latest}")
    return 0


def register(subparsers: Any) -> None:
    from d9d.cli.commands.status import add_lookup_options

    parser = subparsers.add_parser("stop", help="stop a run, found by its name")
    add_lookup_options(parser)
    parser.add_argument(
        "--now",
        action="store_true",
        help="kill the ranks at once (the steps since the last commit are lost) instead of stopping at the "
        "next step boundary with a checkpoint of it",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=_STOP_WAIT_S,
        metavar="S",
        help="kill the ranks if they have not stopped at a step boundary within S seconds "
        f"(default {_STOP_WAIT_S:g})",
    )
    parser.set_defaults(handler=_run)
