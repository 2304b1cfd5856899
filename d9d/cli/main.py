"""Entry point of the `d9d` console script.

Subcommands register themselves through `COMMANDS`, so later areas (engine, cluster, pipeline
simulator, LR plot) add a module without touching the parser's core.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import d9d

Handler = Callable[[argparse.Namespace], int]


def _demo(args: argparse.Namespace) -> int:
    print("demo arrives with the engine and cluster layers")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d9d", description="d9d distributed training")
    parser.add_argument("--version", action="version", version=f"d9d {d9d.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="train the tiny Qwen3-MoE demo on a local Ray instance")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
