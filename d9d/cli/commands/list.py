"""`d9d list`: the runs under a runs root (a local `runs/`, or a `run.storage` root such as `s3://bucket/runs`)
whichever launcher made them (`d9d train` and the rest on Ray, torchrun, `python -m d9d.engine.launch`), and
with `--address` every run of that cluster with a live coordinator or a Ray job, with state, step and last
loss. `--address` is the cluster's dashboard (`http://head:8265`) or its Ray address (`head:6379`)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from d9d.cluster.registry import RunState


class _Rows:
    """The table's runs: one row per run directory; what a cluster says of a run replaces the rows of its
    name read from files."""

    def __init__(self) -> None:
        self.rows: list[RunState] = []

    def __contains__(self, name: str) -> bool:
        return any(r.run_name == name for r in self.rows)

    def source(self, name: str) -> str | None:
        return next((r.source for r in self.rows if r.run_name == name), None)

    def put(self, state: RunState) -> None:
        self.rows = [r for r in self.rows if r.run_name != state.run_name] + [state]


def _from_dashboard(dashboard: str, rows: _Rows, options: dict[str, Any]) -> str | None:
    """Add the cluster's runs as its dashboard knows them: live coordinators (their status from the
    coordinator itself when its Ray address answers here, else from their files) and Ray jobs of runs with
    no live coordinator. Returns why the dashboard could not be asked, or None."""
    from d9d.cluster.addresses import live_coordinators, reachable
    from d9d.cluster.registry import RunState, live_states, read_record, state_from_files
    from d9d.core.storage import location

    if not reachable(dashboard):
        return f"no Ray dashboard answers at {dashboard}"
    try:
        live = live_coordinators(dashboard)
    except Exception as e:  # not a dashboard after all
        return f"cannot list the runs at {dashboard}: {e}"
    gcs = next((c.ray_address for c in live if c.ray_address and reachable(c.ray_address)), None)
    if gcs is not None:
        from d9d.cluster.client import connect

        connect(gcs)
        for state in live_states():
            rows.put(state)
    for coordinator in live:
        if rows.source(coordinator.run_name) == "coordinator":
            continue
        record = None
        if coordinator.run_dir is not None:
            try:
                record = read_record(location(coordinator.run_dir, options))
            except Exception:  # its directory is not readable from here
                record = None
        known = state_from_files(record, options) if record is not None else None
        rows.put(
            RunState(
                coordinator.run_name,
                "live",
                known.step if known else None,
                known.last_loss if known else None,
                coordinator.run_dir,
                "dashboard",
            )
        )
    from d9d.cluster.submit import submitted_runs

    for name, status, terminal in submitted_runs(dashboard):
        if name not in rows or (rows.source(name) == "files" and not terminal):
            rows.put(RunState(name, f"job {status}", None, None, None, "dashboard"))
    return None


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.storage import open_location, storage_options
    from d9d.cluster.addresses import is_dashboard
    from d9d.cluster.registry import records, state_from_files
    from d9d.core.storage import StorageError

    try:
        options = storage_options(args.storage_options)
        found = records(open_location(args.runs_root, options))
    except StorageError as e:
        print(f"d9d list: {e}", file=sys.stderr)
        return 2
    rows = _Rows()
    rows.rows = [state_from_files(r, options) for r in found]
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address and is_dashboard(address):
        problem = _from_dashboard(address, rows, options)
        if problem is not None:
            print(f"d9d list: {problem}; showing the run directories only", file=sys.stderr)
    elif address:
        from d9d.cluster.client import connect
        from d9d.cluster.registry import live_states

        connect(address)
        for state in live_states():  # the coordinator knows better than files
            rows.put(state)
    header = ("RUN", "STATE", "STEP", "LOSS", "LAUNCHER", "FROM", "DIR")
    table = [header] + [
        (
            s.run_name,
            s.state,
            "-" if s.step is None else str(s.step),
            "-" if s.last_loss is None else f"{s.last_loss:.6g}",
            s.launcher,
            s.source,
            s.run_dir or "-",
        )
        for s in sorted(rows.rows, key=lambda s: (s.run_name, s.run_dir or ""))
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    lines = [
        "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]) for row in table
    ]
    sys.stdout.write("\n".join(lines) + "\n")
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
        help="the cluster, as its dashboard (http://head:8265) or Ray address (head:6379, ray://head:10001): "
        "add every run with a live coordinator or a Ray job there (default: RAY_ADDRESS; without either, "
        "only the run directories)",
    )
    parser.set_defaults(handler=_run)
