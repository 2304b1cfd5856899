"""`benchmarks/symm_mem_exchange.py` on CPU (its exchange needs two GPUs with NVSHMEM): the layout its
reference check expects is PyTorch's documented one for `all_to_all_vdev_2d`, and without CUDA it stops
with the reason."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.bench_fixtures import import_benchmark, run_benchmark


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    yield from import_benchmark("symm_mem_exchange")


def test_expected_layout_is_the_documented_one(bench: ModuleType) -> None:
    # PyTorch's example: one expert's blocks of 5 and 7 rows (from ranks 0 and 1), align 16 → the next
    # expert starts at 16. Two ranks, four experts (two per rank); rank 0 receives experts 0 and 1.
    counts = [[5, 3, 1, 1], [7, 0, 2, 2]]
    assert bench.expected_layout(counts, 0, 16) == [(5, 0), (7, 5), (3, 16), (0, 19)]
    # rank 1: expert 2 gets 1 + 2 rows, expert 3 starts at the next multiple of 4
    assert bench.expected_layout(counts, 1, 4) == [(1, 0), (2, 1), (1, 4), (2, 5)]
    # an expert that receives nothing still takes one aligned tile
    assert bench.expected_layout([[0, 1], [0, 1]], 0, 8) == [(0, 0), (0, 0)]
    assert bench.expected_layout([[0, 0, 2, 0], [0, 0, 1, 0]], 0, 8) == [(0, 0), (0, 0), (0, 8), (0, 8)]
    # align 1: blocks back to back
    assert bench.expected_layout([[2, 3], [4, 5]], 0, 1) == [(2, 0), (4, 2)]


def test_without_cuda_it_names_what_it_needs() -> None:
    done = run_benchmark("symm_mem_exchange.py", timeout=120)
    assert done.returncode != 0
    assert "needs CUDA GPUs (NVSHMEM)" in done.stderr
