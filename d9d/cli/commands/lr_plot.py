"""`d9d lr-plot CONFIG -o lr.png`: draw a piecewise LR schedule from a YAML/JSON file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError


def _select(document: Any, key: str | None, source: Path) -> Any:
    if key is None:
        return document
    node = document
    walked: list[str] = []
    for part in key.split("."):
        walked.append(part)
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"{source}: no key {'.'.join(walked)!r}")
        node = node[part]
    return node


def _run(args: argparse.Namespace) -> int:
    from d9d.optim.lr import PiecewiseScheduleConfig, plot_schedule

    source = Path(args.config)
    try:
        document = yaml.safe_load(source.read_text())
        config = PiecewiseScheduleConfig.model_validate(_select(document, args.key, source))
        schedule = config.resolve(args.total_steps)
    except (OSError, yaml.YAMLError, KeyError, ValidationError, ValueError) as error:
        print(f"d9d lr-plot: {error}", file=sys.stderr)
        return 2
    plot_schedule(schedule, args.output, base_lr=args.base_lr, title=args.title or source.name)
    print(f"wrote {args.output} ({schedule.end} steps, {len(schedule.segments)} phases)")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("lr-plot", help="draw a piecewise LR schedule to a PNG")
    parser.add_argument("config", help="YAML or JSON file holding a piecewise scheduler config")
    parser.add_argument("-o", "--output", default="lr.png", help="PNG to write (default: lr.png)")
    parser.add_argument(
        "--total-steps", type=int, default=None, help="run length; needed by percentage and rest phases"
    )
    parser.add_argument("--key", default=None, help="dotted path to the scheduler config inside the file")
    parser.add_argument("--base-lr", type=float, default=None, help="plot LR = base LR × multiplier")
    parser.add_argument("--title", default=None, help="plot title (default: the config file name)")
    parser.set_defaults(handler=_run)
