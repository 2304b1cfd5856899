from __future__ import annotations

import pytest
import torch

from d9d.core import (
    all_gather_object,
    all_gather_object_async,
    all_gather_varshape,
    all_gather_varshape_async,
    gather_object,
    gather_varshape,
    gather_varshape_async,
)
from tests.harness import RankEnv, run_distributed

pytestmark = pytest.mark.distributed


def _rank_tensor(rank: int) -> torch.Tensor:
    # Different rank count, shape and content per rank; rank 1 sends an empty tensor.
    g = torch.Generator().manual_seed(100 + rank)
    rows = 0 if rank == 1 else rank + 2
    return torch.randn(rows, 3, generator=g)


def _varshape(env: RankEnv) -> None:
    mine = _rank_tensor(env.rank)
    expected = [_rank_tensor(r) for r in range(env.world_size)]
    for got in (all_gather_varshape(mine), all_gather_varshape_async(mine).wait()):
        assert len(got) == env.world_size
        for r, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g.shape == e.shape, (r, g.shape, e.shape)
            assert torch.equal(g, e), r
    # Different ndim per rank and integer data.
    ragged = torch.arange(env.rank + 1, dtype=torch.int64).reshape([1] * env.rank + [env.rank + 1])
    got = gather_varshape(ragged, dst=0)
    pending = gather_varshape_async(ragged, dst=0).wait()
    if env.rank == 0:
        assert got is not None and pending is not None
        for r in range(env.world_size):
            assert got[r].shape == (1,) * r + (r + 1,)
            assert torch.equal(got[r].flatten(), torch.arange(r + 1))
            assert torch.equal(pending[r], got[r])
    else:
        assert got is None and pending is None


def _objects(env: RankEnv) -> None:
    obj = {"rank": env.rank, "name": f"r{env.rank}", "nested": [env.rank] * env.rank, "t": (1.5, None)}
    expected = [
        {"rank": r, "name": f"r{r}", "nested": [r] * r, "t": (1.5, None)} for r in range(env.world_size)
    ]
    assert all_gather_object(obj) == expected
    assert all_gather_object_async(obj).wait() == expected
    gathered = gather_object(obj, dst=env.world_size - 1)
    assert gathered == (expected if env.rank == env.world_size - 1 else None)


def _dtype_mismatch(env: RankEnv) -> None:
    t = torch.zeros(2, dtype=torch.float32 if env.rank == 0 else torch.int64)
    with pytest.raises(ValueError, match="one dtype on every rank"):
        all_gather_varshape(t)


@pytest.mark.parametrize("world_size", [2, 4])
def test_varshape_gather_returns_every_rank_tensor_exactly(world_size: int) -> None:
    run_distributed(_varshape, world_size)


@pytest.mark.parametrize("world_size", [1, 3])
def test_object_gather_round_trips(world_size: int) -> None:
    run_distributed(_objects, world_size)


def test_dtype_mismatch_is_reported() -> None:
    run_distributed(_dtype_mismatch, 2)
