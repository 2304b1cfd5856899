"""Entry point of the `d9d` console script; subcommands live in `d9d.cli.commands`.

Printing help or parsing arguments imports no torch, Ray or pydantic: each command module imports what it
needs inside its handler (`tests/test_cli_startup.py` holds every module to that), so `d9d --help`,
`d9d <cmd> --help` and the commands that only read a run directory start at once."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time
from collections.abc import Callable, Sequence

import d9d
import d9d.cli.commands as commands

Handler = Callable[[argparse.Namespace], int]
# When this command began: None for the `d9d` process itself (a launch's start-up then counts from the
# process's start, `d9d.cluster.client.started_from_process`), the call's time when `main` is called in a
# process that was doing other things before (a test, a script).
invoked_at: float | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d9d", description="d9d distributed training")
    parser.add_argument("--version", action="version", version=f"d9d {d9d.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
    return parser


def _closed_pipe() -> int:
    """stdout went away (`d9d status RUN | head`): not an error of the command. Python would still try to
    flush it at exit and complain; point the descriptor at /dev/null first."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (a test's capture)
        pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    global invoked_at
    invoked_at = None if argv is None else time.time()
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    try:
        return handler(args)
    except BrokenPipeError:
        return _closed_pipe()
    except ValueError as e:
        from d9d.engine.errors import ConfigError

        if not isinstance(e, ConfigError):
            raise
        # A configuration problem found after the command's own validation (the driver's preflight): the
        # message names the field or file; a traceback would only bury it.
        print(f"d9d {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
