"""`d9d lr-plot FILE -o lr.png`: draw a piecewise LR schedule.

FILE is a job file (its `lr_scheduler` section; the run length from `trainer.total_steps` and the base LR
from `optimizer.options.lr` unless given), a `{provider: piecewise, options: ...}` section, or a bare
piecewise scheduler config; `--key` picks a dotted path inside any of them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


class _Unplottable(ValueError):
    pass


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


def _job_defaults(document: Any) -> tuple[int | None, float | None]:
    """A job file's run length and the optimizer's base LR, when it states them."""
    if not isinstance(document, dict):
        return None, None
    trainer = document.get("trainer")
    total = trainer.get("total_steps") if isinstance(trainer, dict) else None
    optimizer = document.get("optimizer")
    options = optimizer.get("options") if isinstance(optimizer, dict) else None
    lr = options.get("lr") if isinstance(options, dict) else None
    return (
        total if isinstance(total, int) else None,
        float(lr) if isinstance(lr, int | float) else None,
    )


def _schedule_section(node: Any, where: str) -> tuple[Any, str]:
    """The piecewise options inside `node` and the dotted key they came from (for error messages)."""
    if isinstance(node, dict) and "lr_scheduler" in node:  # a whole job file
        node, where = node["lr_scheduler"], "lr_scheduler"
        if node is None:
            raise _Unplottable("lr_scheduler: the job file has no LR schedule (a constant LR)")
    if isinstance(node, dict) and "provider" in node:  # a component section
        if node["provider"] != "piecewise":
            raise _Unplottable(
                f"{where}.provider: {node['provider']!r}; lr-plot draws the built-in 'piecewise' schedule"
            )
        return node.get("options") or {}, f"{where}.options" if where else "options"
    return node, where


def _run(args: argparse.Namespace) -> int:
    import yaml
    from pydantic import ValidationError

    from d9d.engine.config import read_config_file
    from d9d.engine.errors import format_validation_error
    from d9d.optim.lr import PiecewiseScheduleConfig, plot_schedule

    source = Path(args.config)
    try:
        document = read_config_file(source)  # size-capped, safe YAML, bounded aliases
        total_steps, base_lr = _job_defaults(document)
        section, where = _schedule_section(_select(document, args.key, source), args.key or "")
        try:
            config = PiecewiseScheduleConfig.model_validate(section)
        except ValidationError as e:
            raise _Unplottable(format_validation_error(e, prefix=where)) from None
        total = args.total_steps if args.total_steps is not None else total_steps
        schedule = config.resolve(total)
    except (OSError, yaml.YAMLError, KeyError, ValueError) as error:
        print(f"d9d lr-plot: {source}: {error}", file=sys.stderr)
        return 2
    lr = args.base_lr if args.base_lr is not None else base_lr
    plot_schedule(schedule, args.output, base_lr=lr, title=args.title or source.name)
    print(f"wrote {args.output} ({schedule.end} steps, {len(schedule.segments)} phases)")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("lr-plot", help="draw a piecewise LR schedule to a PNG")
    parser.add_argument(
        "config", help="job file, or a YAML/JSON file holding a piecewise scheduler config or section"
    )
    parser.add_argument("-o", "--output", default="lr.png", help="PNG to write (default: lr.png)")
    parser.add_argument(
        "--total-steps",
        type=int,
        default=None,
        help="run length; needed by percentage and rest phases (default: a job file's trainer.total_steps)",
    )
    parser.add_argument("--key", default=None, help="dotted path to the scheduler config inside the file")
    parser.add_argument(
        "--base-lr",
        type=float,
        default=None,
        help="plot LR = base LR × multiplier (default: a job file's optimizer.options.lr)",
    )
    parser.add_argument("--title", default=None, help="plot title (default: the config file name)")
    parser.set_defaults(handler=_run)
