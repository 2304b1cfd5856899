"""`d9d list`: the runs registered under a runs root (their `run.json`: a local `runs/`, or a `run.storage`
root such as `s3://bucket/runs`), and with `--address` every run with a live coordinator in that cluster,
with state, step and last loss."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.storage import open_location, storage_options
    from d9d.cluster.registry import RunState, live_states, records, state_from_files
    from d9d.core.storage import StorageError

    try:
        options = storage_options(args.storage_options)
        found = records(open_location(args.runs_root, options))
    except StorageError as e:
        print(f"d9d list: {e}", file=sys.stderr)
        return 2
    rows: dict[str, RunState] = {r.run_name: state_from_files(r, options) for r in found}
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address and address.startswith(("http://", "https://")):
        if args.address:
            print(f"d9d list: --address {address} is a dashboard; give the Ray address (head:6379)")
            return 2
        address = None  # an http RAY_ADDRESS is for the Jobs API: files only
    if address:
        from d9d.cluster.client import connect

        connect(address)
        rows.update({s.run_name: s for s in live_states()})  # the coordinator knows better than files
    header = ("RUN", "STATE", "STEP", "LOSS", "FROM", "DIR")
    table = [header] + [
        (
            s.run_name,
            s.state,
            "-" if s.step is None else str(s.step),
            "-" if s.last_loss is None else f"{s.last_loss:.6g}",
            s.source,
            s.run_dir or "-",
        )
        for s in sorted(rows.values(), key=lambda s: s.run_name)
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        print("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]))
    return 0


def register(subparsers: Any) -> None:
    from d9d.cli.storage import add_storage_option

    parser = subparsers.add_parser("list", help="runs with their state, step and last loss")
    parser.add_argument(
        "--runs-root",
        "--storage",
        dest="runs_root",
        default="runs",
        help="where runs are registered: a directory, or a run.storage URI such as s3://bucket/runs "
        "(default: runs)",
    )
    add_storage_option(parser)
    parser.add_argument(
        "--address",
        help="a Ray address (head:6379, ray://head:10001): add every run with a live coordinator there "
        "(default: RAY_ADDRESS; without either, only the run directories)",
    )
    parser.set_defaults(handler=_run)
