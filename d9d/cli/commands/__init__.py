"""Subcommands of the `d9d` console script.

Each module here defines `register(subparsers) -> None`, adding its parser with a `handler`
default (`Callable[[argparse.Namespace], int]`). Modules are discovered automatically, so an area adds
its command without editing the parser core. A module whose optional dependency is missing should
still register and fail with a clear message when run.
"""
