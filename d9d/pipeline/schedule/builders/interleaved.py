"""Interleaved 1F1B (looped placement, v stages per rank), as in Megatron-LM's virtual pipeline.

A rank walks its stages in rounds of p microbatches: forwards of microbatches [k, k + p) through its first
stage, then the same microbatches through its second stage, and so on; backwards walk the stages in reverse.
Warm-up is (v - 1) p forwards to fill the deeper stages plus 2 (p - 1 - r) to cover the round trip of the
gradients, capped by the total. Each rank's share of the pipeline fill drops by v, hence the bubble
(p - 1) / (v m + p - 1). Requires m to be a multiple of p so the rounds are full.
"""

from __future__ import annotations

from d9d.pipeline.schedule.actions import Compute, ComputeAction
from d9d.pipeline.schedule.builders.common import Orders, bwd, fwd


def _nth(rank: int, num_ranks: int, stages_per_rank: int, k: int, *, backward: bool) -> tuple[int, int]:
    """(stage, microbatch) of the k-th forward (or backward) a rank runs."""
    chunk = (k // num_ranks) % stages_per_rank
    if backward:
        chunk = stages_per_rank - 1 - chunk
    mb = (k // (num_ranks * stages_per_rank)) * num_ranks + k % num_ranks
    return chunk * num_ranks + rank, mb


def interleaved_orders(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Orders:
    total = num_microbatches * stages_per_rank
    orders: Orders = []
    for r in range(num_ranks):
        warmup = min((stages_per_rank - 1) * num_ranks + 2 * (num_ranks - 1 - r), total)

        def f(k: int, r: int = r) -> Compute:
            return fwd(*_nth(r, num_ranks, stages_per_rank, k, backward=False))

        def b(k: int, r: int = r) -> Compute:
            return bwd(*_nth(r, num_ranks, stages_per_rank, k, backward=True))

        order: list[ComputeAction] = [f(k) for k in range(warmup)]
        for i in range(total - warmup):
            order += [f(warmup + i), b(i)]
        order += [b(k) for k in range(total - warmup, total)]
        orders.append(order)
    return orders
