"""`d9d status RUN`: where the run is and how far it got, as a short summary (state, step/total, loss,
tokens/s, ETA, restarts and resumes, the last error, start-up time, where its files and trackers are);
`--json` prints the raw record instead (run_summary.json, the live coordinator's status, or the Ray job).

The run is found by its name, whichever launcher made it (see d9d.cluster.lookup): its Ray job with its
actors and latest progress line (`d9d submit`, `ray job submit`), else its live coordinator (`d9d train`,
`--detach`), else its files (a run that ended, a torchrun or one-process run). RUN may also be the run's
directory or its storage root as a URI (`d9d status s3://bucket/runs/<run> --storage-option ...`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from d9d.cli.storage import Lookup


def _print(lines: list[str]) -> None:
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _submission(lookup: Lookup, address: str | None, as_json: bool) -> int:
    from d9d.cluster import submit as jobs
    from d9d.cluster.follow import PREFIX

    sub = lookup.found.submission
    assert sub is not None
    dashboard = jobs.dashboard_address(address)
    actors = jobs.rank_actors(sub.run_name, dashboard)
    # The driver's own lines; not the indented ones that say where its files are, which end a run's log.
    progress = [
        line
        for line in jobs.logs(sub.submission_id, dashboard).splitlines()
        if line.startswith(PREFIX) and not line.startswith(f"{PREFIX}   ")
    ]
    if as_json:
        record = {
            **dataclasses.asdict(sub),
            "actors": dict(actors),
            "last": progress[-1] if progress else None,
        }
        _print([json.dumps(record, indent=1)])
        return 0
    lines = [f"run {sub.run_name}: Ray job {sub.submission_id} {sub.status} {sub.message}".rstrip()]
    lines += [f"  {name}: {state}" for name, state in actors]
    if progress:
        lines.append(f"  last: {progress[-1]}")
    _print(lines)
    return 0


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.storage import lookup_run, not_found
    from d9d.cluster.lookup import attach
    from d9d.cluster.overview import format_overview, overview_from_files, overview_from_status
    from d9d.cluster.registry import launch_of
    from d9d.engine.run_files import SUMMARY_FILE

    lookup = lookup_run(args, "status")
    if lookup is None:
        return 2
    run, run_dir, root, options, loc = lookup.run, lookup.run_dir, lookup.root, lookup.options, lookup.found
    if loc.submission is not None:
        return _submission(lookup, args.address, args.json)
    record = loc.record
    files = record.files(options) if record is not None else (run_dir or root / run)
    job = attach(loc)
    if job is not None:
        status = job.status()
        if args.json:
            _print([json.dumps({**dataclasses.asdict(status), "state": status.state.value}, indent=1)])
            return 0
        assert loc.ray_address is not None
        local = files if record is not None else Path(job.spec.run_dir)
        _print(format_overview(overview_from_status(status, local, record, loc.ray_address)))
        return 0
    summary = files / SUMMARY_FILE
    try:
        launch = launch_of(record, options) if record is not None else None
        if args.json:
            if not summary.is_file():
                print(f"d9d status: run {run!r}: no {SUMMARY_FILE} in {files}", file=sys.stderr)
                return 1
            _print([json.dumps(json.loads(summary.read_text()), indent=1)])
            return 0
        if record is None and not summary.is_file():
            why = loc.jobs_error or f"no Ray job for run {run!r}"
            print(f"d9d status: {why}; no live coordinator, and {not_found(lookup)}", file=sys.stderr)
            return 1
        if launch is None and record is None:
            from d9d.engine.run_files import read_launches

            launches = read_launches(summary) or []
            launch = launches[-1] if launches else None
        overview = overview_from_files(record, files, launch, run)
    except BrokenPipeError:
        raise
    except Exception as e:  # the store's client: name what could not be read
        print(f"d9d status: cannot read {files}: {e}", file=sys.stderr)
        return 2
    if overview.state == "started" and record is not None and record.launcher == "ray":
        overview.extra.append(
            f"no end recorded and no live coordinator reachable (cluster {record.ray_address}); "
            f"`d9d resume {record.run_dir}` continues it if it died"
        )
    _print(format_overview(overview))
    return 1 if overview.state == "started" and record is not None and record.launcher == "ray" else 0


def add_lookup_options(parser: argparse.ArgumentParser) -> None:
    from d9d.cli.storage import add_storage_option

    parser.add_argument(
        "run",
        help="run name (or a submission id), or the run's directory or storage URI (s3://bucket/runs/<run>)",
    )
    parser.add_argument(
        "--address",
        help="the cluster: its dashboard (http://head:8265: Ray jobs, and live coordinators through the "
        "state API) or a Ray address (head:6379, ray://head:10001: live coordinators); default: RAY_ADDRESS, "
        "else the run's record, else http://127.0.0.1:8265",
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
    parser.add_argument(
        "--json", action="store_true", help="print the raw record (run_summary.json, or the live status)"
    )
    parser.set_defaults(handler=_run)
