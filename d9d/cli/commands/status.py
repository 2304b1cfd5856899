"""`d9d status RUN`: where the run is and how far it got — its Ray job with its actors and latest progress
line (`d9d submit`, `ray job submit`), else its live coordinator (`d9d train`, `--detach`), else its
run_summary.json (a run that ended; see d9d.cluster.lookup)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from d9d.cluster import submit as jobs
    from d9d.cluster.follow import PREFIX
    from d9d.cluster.lookup import attach, locate

    loc = locate(args.run, args.address, args.run_dir, args.runs_root)
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
        return 0
    run_dir = args.run_dir or (Path(loc.record.run_dir) if loc.record else args.runs_root / args.run)
    summary = run_dir / "run_summary.json"
    if summary.is_file() and (loc.record is None or loc.ended):
        print(json.dumps(json.loads(summary.read_text()), indent=1))
        return 0
    if loc.record is not None:
        print(
            f"run {args.run}: started {loc.record.driver and 'by ' + loc.record.driver}, no end recorded and "
            f"no live coordinator reachable (cluster {loc.record.ray_address}); see {run_dir}"
        )
        return 1
    why = loc.jobs_error or f"no Ray job for run {args.run!r}"
    print(f"d9d status: {why}; no live coordinator or run directory either", file=sys.stderr)
    return 1


def add_lookup_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run name (or a submission id)")
    parser.add_argument(
        "--address",
        help="dashboard address for Ray jobs (http://head:8265; default: RAY_ADDRESS or "
        "http://127.0.0.1:8265), or a Ray address (head:6379, ray://head:10001) to reach the coordinator",
    )
    parser.add_argument("--run-dir", type=Path, help="the run's directory (default: found under --runs-root)")
    parser.add_argument(
        "--runs-root",
        type=Path,
        default=Path("runs"),
        help="where run directories are looked up (default: runs)",
    )


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("status", help="state of a run, found by its name")
    add_lookup_options(parser)
    parser.set_defaults(handler=_run)
