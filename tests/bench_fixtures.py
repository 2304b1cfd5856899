"""Importing the benchmark scripts in tests: `benchmarks/` is no package (its scripts import each other,
and `throughput`, by name), so a test puts the folder on `sys.path` while it imports."""

from __future__ import annotations

import contextlib
import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def benchmarks_on_path() -> Iterator[None]:
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))


def import_benchmark(name: str) -> Iterator[ModuleType]:
    """The body of a module-scoped fixture: `yield from import_benchmark("multi_gpu")`."""
    with benchmarks_on_path():
        yield importlib.import_module(name)


def run_benchmark(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python benchmarks/<script> <args>` in a fresh process with the tests' environment, its output
    captured; the caller asserts on the result."""
    from tests.engine_fixtures import subprocess_env

    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
