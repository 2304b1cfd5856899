"""`d9d logs RUN`: a run's output, found by its name: the driver log of its Ray job (`d9d submit`, `ray job
submit`; rank output forwarded into it), else the rank log files in its run directory, or in its storage
root where the run's writer copied them (`run.storage`; RUN may be that URI: `s3://bucket/runs/<run>`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from d9d.core.storage import Location

_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def _job_logs(submission_id: str, address: str, follow: bool) -> int:
    from d9d.cluster import submit as jobs

    shown = 0
    while True:
        text = jobs.logs(submission_id, address)
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown = len(text)
        if not follow or jobs.find(submission_id, address).status in _TERMINAL:
            return 0
        time.sleep(1.0)


def _log_files(logs: Location) -> list[Location]:
    found: list[Location] = list(logs.glob("*.log"))
    return sorted(found, key=str)


def _file_logs(logs: Location, follow: bool, running: Any) -> int:
    """Every rank's log file in `logs`; with `follow`, what they add until the run has ended."""
    shown: dict[Location, int] = {}
    current: Location | None = None
    while True:
        ended = not follow or not running()
        for path in _log_files(logs):
            text = path.read_bytes().decode(errors="replace")
            new = text[shown.get(path, 0) :]
            if new:
                if path != current:
                    print(f"==> {path} <==")
                    current = path
                sys.stdout.write(new)
            shown[path] = len(text)
        sys.stdout.flush()
        if ended:
            return 0
        time.sleep(1.0)


def _logs_dir(run_dir: Location | None, files: Location | None) -> Location | None:
    """The run directory's `logs/` (written as the run goes), else the storage root's copy."""
    from d9d.engine.run_files import LOGS_DIR

    for where in (run_dir, files):
        if where is not None and (where / LOGS_DIR).is_dir():
            return where / LOGS_DIR
    return None


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.storage import lookup_run, not_found
    from d9d.cluster.addresses import dashboard_address
    from d9d.cluster.lookup import attach

    lookup = lookup_run(args, "logs")
    if lookup is None:
        return 2
    run, run_dir, options, loc = lookup.run, lookup.run_dir, lookup.options, lookup.found
    if loc.submission is not None:
        return _job_logs(loc.submission.submission_id, dashboard_address(args.address), args.follow)
    record = loc.record
    try:
        logs = _logs_dir(
            run_dir or (Path(record.run_dir) if record else None), record.files(options) if record else None
        )
    except Exception as e:  # the store's client: name what could not be read
        print(f"d9d logs: run {run!r}: cannot read its files: {e}", file=sys.stderr)
        return 2
    if logs is None:
        where = "no run directory with logs found" if record is not None else not_found(lookup)
        print(f"d9d logs: run {run!r}: no Ray job, and {where}", file=sys.stderr)
        return 1
    job = attach(loc) if args.follow else None
    return _file_logs(logs, args.follow, lambda: job is not None and not job.status().state.terminal)


def register(subparsers: Any) -> None:
    from d9d.cli.commands.status import add_lookup_options

    parser = subparsers.add_parser("logs", help="logs of a run, found by its name")
    add_lookup_options(parser)
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    parser.set_defaults(handler=_run)
