"""`d9d config-reference`: every key a job file accepts (engine sections and `cluster:`), as a Markdown table;
`--write docs/engine.md` rewrites the generated block of a document in place."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from d9d.engine.config_reference import Root


def job_roots() -> tuple[Root, ...]:
    """Every section of a job file: the engine's and `cluster:`."""
    from d9d.cluster.config import ClusterConfig
    from d9d.engine.config_reference import ENGINE_ROOTS

    return (*ENGINE_ROOTS, ("cluster", ClusterConfig))


def _run(args: argparse.Namespace) -> int:
    from d9d.engine.config_reference import render_reference, splice

    roots = job_roots()
    if args.write is None:
        print(render_reference(roots))
        return 0
    for path in args.write:
        path.write_text(splice(path.read_text(), roots))
        print(f"updated the configuration reference in {path}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "config-reference", help="print every job-file key with its type and default (Markdown table)"
    )
    parser.add_argument(
        "--write",
        type=Path,
        action="append",
        metavar="DOC",
        help="rewrite the block between the config-reference markers of this Markdown file instead of "
        "printing (repeatable)",
    )
    parser.set_defaults(handler=_run)
