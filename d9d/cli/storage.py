"""Reading a run's files from the command line wherever they live: a local directory, or a storage URI
(`s3://bucket/runs/<run>`, `gs://...`, `memory://...`) with `--storage-option KEY=VALUE` for what the
store needs (an S3 `endpoint_url`, say; credentials are better left to the environment)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from d9d.core.storage import Location, StorageError, is_uri, location

if TYPE_CHECKING:
    from d9d.cluster.lookup import Located


def add_storage_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-option",
        dest="storage_options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the storage URI's file system (fsspec), value parsed as YAML "
        "(e.g. --storage-option endpoint_url=http://minio:9000); repeatable",
    )


def storage_options(items: Sequence[str]) -> dict[str, Any]:
    if not items:
        return {}
    from d9d.engine.config import ConfigError, load_yaml

    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise StorageError(f"--storage-option {item!r}: expected KEY=VALUE")
        try:
            options[key] = load_yaml(value, f"--storage-option {key}")
        except ConfigError as e:
            raise StorageError(str(e)) from None
    return options


def open_location(text: str, options: dict[str, Any]) -> Location:
    """`text` as a local path or a storage URI; `StorageError` naming it when its store cannot be opened
    or asked (an unknown protocol, a missing `storage` extra, an endpoint that does not answer)."""
    try:
        loc = location(text, options if is_uri(text) else None)
    except StorageError as e:
        raise StorageError(f"{text}: {e}") from None
    try:
        loc.exists()
    except Exception as e:  # whatever the store's client raises: the message must name the URI
        raise StorageError(f"cannot read {text}: {e}") from e
    return loc


def run_name_of(text: str) -> str:
    """The run a run directory or storage URI names: its last path component."""
    return text.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Lookup:
    """A lookup command's run: its name, its run directory if named, the runs root, the storage options,
    and where it was found (`d9d.cluster.lookup.locate`)."""

    run: str
    run_dir: Location | None
    root: Location
    options: dict[str, Any]
    found: Located


def lookup_run(args: argparse.Namespace, command: str) -> Lookup | None:
    """Find the run a lookup command names (RUN may be a run name, or a run's directory or storage URI such
    as `s3://bucket/runs/<run>`); None, after saying why on stderr, when a store cannot be read."""
    from d9d.cluster.lookup import locate

    try:
        options = storage_options(args.storage_options)
        run: str = args.run
        run_dir = None if args.run_dir is None else open_location(args.run_dir, options)
        if is_uri(run) and run_dir is None:
            run_dir = open_location(run, options)
            run = run_name_of(run)
        root = open_location(args.runs_root, options)
        found = locate(run, args.address, run_dir, root, options)
    except StorageError as e:
        print(f"d9d {command}: {e}", file=sys.stderr)
        return None
    return Lookup(run, run_dir, root, options, found)


def not_found(lookup: Lookup) -> str:
    """Where a run that nothing was found of was looked for: its run directory, spelled out (a run name is
    looked up under the runs root, `runs/` of the current directory by default)."""
    where = lookup.run_dir if lookup.run_dir is not None else lookup.root / lookup.run
    shown = where.resolve() if isinstance(where, Path) else where
    hint = "" if lookup.run_dir is not None else " (run this where its runs/ is, or pass --run-dir)"
    return f"no run directory {shown}{hint}"
