"""Forward-only and GPipe: every forward first, then (for training) every backward."""

from __future__ import annotations

from d9d.pipeline.schedule.builders.common import Orders, bwd, fwd


def inference_orders(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Orders:
    """Looped placement, stage by stage: a rank runs all microbatches through one stage, then the next."""
    orders: Orders = [
        [
            fwd(chunk * num_ranks + rank, mb)
            for chunk in range(stages_per_rank)
            for mb in range(num_microbatches)
        ]
        for rank in range(num_ranks)
    ]
    return orders


def gpipe_orders(num_ranks: int, num_microbatches: int) -> Orders:
    """All forwards, then all backwards in the same microbatch order. Holds every microbatch's activations."""
    orders: Orders = [[] for _ in range(num_ranks)]
    for rank, order in enumerate(orders):
        order += [fwd(rank, mb) for mb in range(num_microbatches)]
        order += [bwd(rank, mb) for mb in range(num_microbatches)]
    return orders
