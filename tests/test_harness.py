"""The harness must fail fast and point at the right rank; otherwise every distributed test lies."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import DistributedTestFailure, RankEnv, distributed, run_distributed

pytestmark = pytest.mark.distributed


def _all_reduce_sum(env: RankEnv) -> None:
    t = torch.tensor([float(env.rank)])
    dist.all_reduce(t)
    assert t.item() == sum(range(env.world_size))
    (env.tmp_dir / f"rank{env.rank}.txt").write_text("done")


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_ranks_run_and_share_tmp_dir(world_size: int, tmp_path) -> None:
    run_distributed(_all_reduce_sum, world_size, tmp_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.glob("rank*.txt")) == sorted(
        f"rank{r}.txt" for r in range(world_size)
    )


def _fail_on_rank_3(env: RankEnv) -> None:
    if env.rank == 3:
        assert env.rank == 0, "deliberate failure on rank three"
    dist.barrier()


def test_assertion_reports_the_failing_rank() -> None:
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_fail_on_rank_3, 4, timeout=30)
    message = str(info.value)
    assert message.startswith("rank 3 failed")
    assert "deliberate failure on rank three" in message


def _hang_on_rank_1(env: RankEnv) -> None:
    if env.rank == 1:
        time.sleep(3600)


def test_hanging_rank_fails_within_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_hang_on_rank_1, 2, timeout=6, init_process_group=False)
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"harness took {elapsed:.1f}s to give up on a 6s timeout"
    message = str(info.value)
    assert "timed out after 6s" in message
    assert "ranks still running: [1]" in message
    assert "_hang_on_rank_1" in message  # the stack of the hung rank is shown


def _crash_rank_0(env: RankEnv) -> None:
    import os

    if env.rank == 0:
        os._exit(7)


def test_rank_that_dies_is_reported() -> None:
    with pytest.raises(DistributedTestFailure, match="rank 0 exited with code 7"):
        run_distributed(_crash_rank_0, 2, timeout=30, init_process_group=False)


@distributed(world_size=2, timeout=30)
def test_decorator_form(env: RankEnv) -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0
