"""`d9d status RUN`: where the run is and how far it got — its Ray job with its actors and latest progress
line (`d9d submit`, `ray job submit`), else its live coordinator (`d9d train`, `--detach`), else its
run_summary.json (a run that ended; see d9d.cluster.lookup). RUN may also be the run's directory or its
storage root as a URI (`d9d status s3://bucket/runs/<run> --storage-option endpoint_url=...`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.storage import lookup_run
    from d9d.cluster import submit as jobs
    from d9d.cluster.follow import PREFIX
    from d9d.cluster.lookup import attach
    from d9d.cluster.state import SUMMARY_FILE

    lookup = lookup_run(args, "status")
    if lookup is None:
        return 2
    run, run_dir, root, options, loc = lookup.run, lookup.run_dir, lookup.root, lookup.options, lookup.found
    sub = loc.submission
    if sub is not None:
        address = jobs.dashboard_address(args.address)
        print(f"run {sub.run_name}: Ray job {sub.submission_id} {sub.status} {sub.message}".rstrip())
        for name, state in jobs.rank_actors(sub.run_name, address):
            print(f"  {name}: {state}")
        progress = [
            line for line in jobs.logs(sub.submission_id, address).splitlines() if line.startswith(PREFIX)
        ]
        if progress:
            print(f"  last: {progress[-1]}")
        return 0
    job = attach(loc)
    if job is not None:
        status = job.status()
        loss = "" if status.last_loss is None else f", loss {status.last_loss:.6g}"
        print(
            f"run {status.run_name}: {status.state.value} step {status.step}/{status.total_steps}{loss} "
            f"(attempt {status.attempt}, {status.world_size} ranks; coordinator at {loc.ray_address})"
        )
        if status.last_failure:
            print(f"  last failure: {status.last_failure}")
        if status.error:
            print("  error: " + status.error.replace("\n", "\n    "))
        return 0
    files = loc.record.files(options) if loc.record else (run_dir or root / run)
    summary = files / SUMMARY_FILE
    try:
        if summary.is_file() and (loc.record is None or loc.ended):
            print(json.dumps(json.loads(summary.read_text()), indent=1))
            return 0
    except Exception as e:  # the store's client: name what could not be read
        print(f"d9d status: cannot read {summary}: {e}", file=sys.stderr)
        return 2
    if loc.record is not None:
        print(
            f"run {run}: started {loc.record.driver and 'by ' + loc.record.driver}, no end recorded and "
            f"no live coordinator reachable (cluster {loc.record.ray_address}); see {files}"
        )
        return 1
    why = loc.jobs_error or f"no Ray job for run {run!r}"
    if run_dir is not None:
        print(f"d9d status: {why}; no live coordinator, and nothing of the run at {run_dir}", file=sys.stderr)
        return 1
    print(f"d9d status: {why}; no live coordinator or run directory either", file=sys.stderr)
    return 1


def add_lookup_options(parser: argparse.ArgumentParser) -> None:
    from d9d.cli.storage import add_storage_option

    parser.add_argument(
        "run",
        help="run name (or a submission id), or the run's directory or storage URI (s3://bucket/runs/<run>)",
    )
    parser.add_argument(
        "--address",
        help="dashboard address for Ray jobs (http://head:8265; default: RAY_ADDRESS or "
        "http://127.0.0.1:8265), or a Ray address (head:6379, ray://head:10001) to reach the coordinator",
    )
    parser.add_argument(
        "--run-dir", help="the run's directory or storage URI (default: found under --runs-root)"
    )
    parser.add_argument(
        "--runs-root",
        "--storage",
        dest="runs_root",
        default="runs",
        help="where runs are looked up by name: a directory, or a run.storage URI such as s3://bucket/runs "
        "(default: runs)",
    )
    add_storage_option(parser)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("status", help="state of a run, found by its name")
    add_lookup_options(parser)
    parser.set_defaults(handler=_run)
