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
from d9d.cluster.auth import AUTH_HINT, RayAuthRefused, auth_refused, use_token_at_hand

__all__ = ["AUTH_HINT", "auth_refused", "build_parser", "main", "ray_auth_from_token"]

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


def ray_auth_from_token() -> bool:
    """Ray (2.5x) starts a local instance with token authentication whenever RAY_AUTH_MODE is unset (what
    `d9d train` without --address does, and `ray.init()`), but a client that joins a cluster by its address
    sends no token unless told: `d9d status/stop/logs RUN` of that run would be refused ("Authentication
    token is missing or incorrect"). So with RAY_AUTH_MODE unset and a token at hand where Ray looks for
    one (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), d9d's commands use it; a cluster without
    authentication accepts such a client as well. An explicit RAY_AUTH_MODE is left alone. Whether it set
    the variable (`d9d.cluster.auth`, which `connect()` uses too)."""
    return use_token_at_hand()


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
    set_auth = ray_auth_from_token()
    try:
        return handler(args)
    except BrokenPipeError:
        return _closed_pipe()
    except ConnectionError as e:
        if not auth_refused(e):
            raise
        said = e if isinstance(e, RayAuthRefused) else f"{e}: {AUTH_HINT}"  # (the former says what to do)
        print(f"d9d {args.command}: {said}", file=sys.stderr)
        return 2
    except ValueError as e:
        from d9d.engine.errors import ConfigError

        if not isinstance(e, ConfigError):
            raise
        # A configuration problem found after the command's own validation (the driver's preflight): the
        # message names the field or file; a traceback would only bury it.
        print(f"d9d {args.command}: {e}", file=sys.stderr)
        return 2
    finally:
        if set_auth:  # a caller that runs `main` in its own process (a test, a script) gets its env back
            os.environ.pop("RAY_AUTH_MODE", None)


if __name__ == "__main__":
    sys.exit(main())
