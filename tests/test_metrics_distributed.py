"""Synced metrics equal the single-process result on all ranks' data (gloo, each rank different data)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from d9d.metrics import AsyncMetricCollector, ComposeMetric, Metric, SumMetric, to_scalars
from tests.harness import RankEnv, run_distributed
from tests.test_metrics_support import assert_trees_close, catalogue, catalogue_inputs

pytestmark = pytest.mark.distributed


class ExactMedian(Metric[torch.Tensor]):
    """A non-additive metric: keeps every value in a "cat" state, so sync must gather, not add."""

    def __init__(self) -> None:
        super().__init__()
        self.values = self.add_state("values", torch.zeros(0, dtype=torch.float64), "cat")

    def update(self, values: torch.Tensor) -> None:
        self.values.value = torch.cat([self.values.value, values.detach().double().reshape(-1)])

    def compute(self) -> torch.Tensor:
        return self.values.value.median()


def _rank_batches(rank: int, steps: int) -> list[dict[str, object]]:
    # Ranks see different data and different batch sizes; rank 1 has an extra empty-ish step.
    return [catalogue_inputs(1000 * rank + step, n=16 + 8 * rank) for step in range(steps)]


def _median_values(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(77 + rank)
    return torch.randn(0 if rank == 1 else 5 + 3 * rank, generator=g)


def _sync_equals_single_process(env: RankEnv) -> None:
    steps = 3
    local = catalogue()
    for batch in _rank_batches(env.rank, steps):
        local.update(batch)
    median = ExactMedian()
    median.update(_median_values(env.rank))

    reference = catalogue()
    for rank in range(env.world_size):
        for batch in _rank_batches(rank, steps):
            reference.update(batch)
    all_values = torch.cat([_median_values(r) for r in range(env.world_size)]).double()

    saved_local = local.state_dict()
    local.sync()
    median.sync()
    assert_trees_close(local.compute(), reference.compute())
    assert torch.equal(median.values.value, all_values)  # gathered in rank order
    assert median.compute() == all_values.median()

    # Elastic resume recipe: after a sync rank 0 alone keeps the global state, the others start fresh;
    # a later sync over any number of ranks gives the global result again.
    resumed = catalogue()
    if env.rank == 0:
        resumed.load_state_dict(local.state_dict())
    resumed.sync()
    assert_trees_close(resumed.compute(), reference.compute())

    # Mid-stream resume on the same world size: reload the local pre-sync states and continue.
    again = catalogue()
    again.load_state_dict(saved_local)
    extra = catalogue_inputs(5000 + env.rank)
    again.update(extra)
    for rank in range(env.world_size):
        reference.update(catalogue_inputs(5000 + rank))
    again.sync()
    assert_trees_close(again.compute(), reference.compute())


@pytest.mark.parametrize("world_size", [2, 4])
def test_sync_equals_single_process_on_all_data(world_size: int) -> None:
    run_distributed(_sync_equals_single_process, world_size, timeout=120)


def _collector_windows(env: RankEnv) -> None:
    live = catalogue()
    windows = [(0, 2, True), (2, 3, False), (3, 5, False)]  # (first step, end step, reset after schedule)
    with AsyncMetricCollector(live) as collector:
        for window, (start, end, reset) in enumerate(windows):
            for step in range(start, end):
                live.update(catalogue_inputs(100 * env.rank + step))
            collector.schedule(window, reset=reset)
            # The training thread keeps issuing its own collectives on the default group meanwhile.
            marker = torch.tensor(float(env.rank))
            dist.all_reduce(marker)
            assert marker.item() == sum(range(env.world_size))
        got = collector.results(wait=True)

    assert [w for w, _ in got] == [0, 1, 2]
    # Window 1 did not reset, so window 2's snapshot holds steps 2..4.
    spans = [(0, 2), (2, 3), (2, 5)]
    for (_, value), (start, end) in zip(got, spans, strict=True):
        reference = catalogue()
        for rank in range(env.world_size):
            for step in range(start, end):
                reference.update(catalogue_inputs(100 * rank + step))
        assert_trees_close(value, reference.compute())
    # The live metric was never synced: it still holds only this rank's data since the last reset.
    own = catalogue()
    for step in range(2, 5):
        own.update(catalogue_inputs(100 * env.rank + step))
    assert_trees_close(live.compute(), own.compute())


def test_async_collector_matches_single_process_per_window() -> None:
    run_distributed(_collector_windows, 3, timeout=120)


def _subgroup(env: RankEnv) -> None:
    pair = dist.new_group([1, 2])  # every rank takes part in creating the group
    if env.rank not in (1, 2):
        return
    metric = ComposeMetric({"n": SumMetric()})
    metric.update({"n": torch.tensor(float(env.rank))})
    with AsyncMetricCollector(metric, group=pair) as collector:  # only members construct it
        collector.schedule(0)
        ((step, value),) = collector.results(wait=True)
    assert step == 0
    assert to_scalars(value) == {"n": 3.0}


def test_collector_over_a_subgroup() -> None:
    run_distributed(_subgroup, 4, timeout=90)
