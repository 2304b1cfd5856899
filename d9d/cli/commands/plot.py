"""`d9d plot RUN`: draw a run's loss, learning rate, gradient norm and tokens/s into one PNG.

RUN is a run directory, a job file (its run directory), a run name (found under `--runs-root`, default
`runs/`, whichever launcher made it), or a run's storage root as a URI (`s3://bucket/runs/<run>`, where a
run with `run.storage` copies its history). The curves come from `<run dir>/history.jsonl`, which every
run writes whatever its tracker; a run in progress is drawn as far as it got. The PNG goes to
`<run dir>/plots/training.png`, or for a URI to `./<run>-training.png`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from d9d.core.storage import Location


def run_directory(target: str, options: dict[str, Any] | None = None, runs_root: str = "runs") -> Location:
    """The run directory `target` names (see the module docstring)."""
    from d9d.cli.storage import open_location
    from d9d.cluster.registry import find_record
    from d9d.core.storage import is_uri

    if is_uri(target):
        return open_location(target, options or {})
    path = Path(target)
    if path.is_dir():
        return path
    if path.is_file():
        from d9d.engine.config import parse_config, read_config_file

        data = read_config_file(path)
        data.pop("cluster", None)
        return parse_config(data, check_components=False).run_dir
    root = open_location(runs_root, options or {})
    record = find_record(target, None, root)  # any launcher's run, by its name
    return record.files(options) if record is not None else root / target


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.storage import storage_options
    from d9d.core.storage import StorageError
    from d9d.engine.errors import ConfigError
    from d9d.tracking.history import HISTORY_FILE, read_history
    from d9d.tracking.plot import PLOT_FILE, plot_history

    try:
        run_dir = run_directory(args.run, storage_options(args.storage_options), args.runs_root)
    except (ConfigError, StorageError, ValueError, OSError) as e:
        print(f"d9d plot: {args.run}: {e}", file=sys.stderr)
        return 2
    history_file = run_dir / HISTORY_FILE
    try:
        found = history_file.is_file()
        history = read_history(history_file) if found else {}
    except Exception as e:  # the store's client: name what could not be read
        print(f"d9d plot: cannot read {history_file}: {e}", file=sys.stderr)
        return 2
    if not found:
        print(f"d9d plot: no {HISTORY_FILE} in {run_dir} (no step has been logged there)", file=sys.stderr)
        return 2
    if not history:
        print(f"d9d plot: {history_file} holds no metrics yet", file=sys.stderr)
        return 2
    if args.output is not None:
        output = Path(args.output)
    elif isinstance(run_dir, Path):
        output = run_dir / PLOT_FILE
    else:
        output = Path(f"{run_dir.name}-training.png")
    plot_history(history, output, title=args.title or run_dir.name)
    last = max(max(series) for series in history.values())
    print(f"wrote {output} ({last} steps of {run_dir})")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("plot", help="draw a run's loss, LR, grad norm and tokens/s to a PNG")
    from d9d.cli.storage import add_storage_option

    parser.add_argument(
        "run", help="run directory, job file, run name (runs/<name>), or storage URI (s3://bucket/runs/<run>)"
    )
    parser.add_argument(
        "-o", "--output", default=None, help="PNG to write (default: <run dir>/plots/training.png)"
    )
    parser.add_argument("--title", default=None, help="plot title (default: the run directory's name)")
    parser.add_argument(
        "--runs-root",
        "--storage",
        dest="runs_root",
        default="runs",
        help="where a run name is looked up: a directory, or a run.storage URI such as s3://bucket/runs "
        "(default: runs)",
    )
    add_storage_option(parser)
    parser.set_defaults(handler=_run)
