"""Entry point of the `d9d` console script; subcommands live in `d9d.cli.commands`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence

import d9d
import d9d.cli.commands as commands
from d9d.engine.errors import ConfigError

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d9d", description="d9d distributed training")
    parser.add_argument("--version", action="version", version=f"d9d {d9d.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return handler(args)
    except ConfigError as e:
        # A configuration problem found after the command's own validation (the driver's preflight): the
        # message names the field or file; a traceback would only bury it.
        print(f"d9d {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
