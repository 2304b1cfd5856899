"""Importing the benchmark scripts in tests: `benchmarks/` is no package (its scripts import each other,
and `throughput`, by name), so a test puts the folder on `sys.path` while it imports."""

from __future__ import annotations

import contextlib
import importlib
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
