"""`d9d plot RUN`: draw a run's loss, learning rate, gradient norm and tokens/s into one PNG.

RUN is a run directory, a job file (its run directory), or a run name (`runs/<name>`). The curves come from
`<run dir>/history.jsonl`, which every run writes whatever its tracker; a run in progress is drawn as far
as it got.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def run_directory(target: str) -> Path:
    """The run directory `target` names (see the module docstring)."""
    from d9d.engine.config import parse_config, read_config_file

    path = Path(target)
    if path.is_dir():
        return path
    if path.is_file():
        data = read_config_file(path)
        data.pop("cluster", None)
        return parse_config(data, check_components=False).run_dir
    return Path("runs") / target


def _run(args: argparse.Namespace) -> int:
    from d9d.engine.config import ConfigError
    from d9d.tracking.history import HISTORY_FILE, read_history
    from d9d.tracking.plot import PLOT_FILE, plot_history

    try:
        run_dir = run_directory(args.run)
    except (ConfigError, ValueError, OSError) as e:
        print(f"d9d plot: {args.run}: {e}", file=sys.stderr)
        return 2
    history_file = run_dir / HISTORY_FILE
    if not history_file.is_file():
        print(f"d9d plot: no {HISTORY_FILE} in {run_dir} (no step has been logged there)", file=sys.stderr)
        return 2
    history = read_history(history_file)
    if not history:
        print(f"d9d plot: {history_file} holds no metrics yet", file=sys.stderr)
        return 2
    output = Path(args.output) if args.output is not None else run_dir / PLOT_FILE
    plot_history(history, output, title=args.title or run_dir.name)
    last = max(max(series) for series in history.values())
    print(f"wrote {output} ({last} steps of {run_dir})")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("plot", help="draw a run's loss, LR, grad norm and tokens/s to a PNG")
    parser.add_argument("run", help="run directory, job file, or run name (runs/<name>)")
    parser.add_argument(
        "-o", "--output", default=None, help="PNG to write (default: <run dir>/plots/training.png)"
    )
    parser.add_argument("--title", default=None, help="plot title (default: the run directory's name)")
    parser.set_defaults(handler=_run)
