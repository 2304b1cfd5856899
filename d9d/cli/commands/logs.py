"""`d9d logs RUN`: a run's output, found by its name: the driver log of its Ray job (`d9d submit`, `ray job
submit`; rank output forwarded into it), else the rank log files in its run directory."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

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


def _file_logs(run_dir: Path, follow: bool, running: Any) -> int:
    """Every rank's log file; with `follow`, what they add until the run has ended."""
    shown: dict[Path, int] = {}
    current: Path | None = None
    while True:
        ended = not follow or not running()
        for path in sorted((run_dir / "logs").glob("*.log")):
            text = path.read_text(errors="replace")
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


def _run(args: argparse.Namespace) -> int:
    from d9d.cluster import submit as jobs
    from d9d.cluster.lookup import attach, locate

    loc = locate(args.run, args.address, args.run_dir, args.runs_root)
    if loc.submission is not None:
        return _job_logs(loc.submission.submission_id, jobs.dashboard_address(args.address), args.follow)
    run_dir = args.run_dir or (Path(loc.record.run_dir) if loc.record else None)
    if run_dir is None or not (run_dir / "logs").is_dir():
        print(f"d9d logs: run {args.run!r}: no Ray job and no run directory with logs found", file=sys.stderr)
        return 1
    job = attach(loc) if args.follow else None
    return _file_logs(run_dir, args.follow, lambda: job is not None and not job.status().state.terminal)


def register(subparsers: Any) -> None:
    from d9d.cli.commands.status import add_lookup_options

    parser = subparsers.add_parser("logs", help="logs of a run, found by its name")
    add_lookup_options(parser)
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    parser.set_defaults(handler=_run)
