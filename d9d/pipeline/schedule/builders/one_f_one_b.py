"""1F1B and its zero-bubble variant ZB1P (one stage per rank).

Rank r first runs p - 1 - r forwards (warm-up), then alternates one forward with one backward, then drains the
remaining backwards. At most p - r microbatches are in flight on rank r.

ZB1P (ZB-H1 in the zero-bubble paper) splits each backward into its input part I, which stays where 1F1B runs
the backward because the previous stage waits for it, and its weight part W, which nobody waits for. Rank r
runs W of microbatch j right after I of microbatch j + r: early ranks, which idle longest while gradients
travel back, catch up on weights later. Every rank then holds at most p microbatches, the peak of rank 0 in
1F1B, and the bubble shrinks from (p - 1)(F + B) to (p - 1)(F + I - W) per rank.
"""

from __future__ import annotations

from d9d.pipeline.schedule.actions import ComputeAction
from d9d.pipeline.schedule.builders.common import Orders, bwd, bwd_input, bwd_weight, fwd


def _one_f_one_b(rank: int, num_ranks: int, num_microbatches: int) -> list[tuple[str, int]]:
    warmup = min(num_ranks - 1 - rank, num_microbatches)
    order = [("F", mb) for mb in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", mb) for mb in range(num_microbatches - warmup, num_microbatches)]
    return order


def one_f_one_b_orders(num_ranks: int, num_microbatches: int) -> Orders:
    return [
        [
            fwd(r, mb) if kind == "F" else bwd(r, mb)
            for kind, mb in _one_f_one_b(r, num_ranks, num_microbatches)
        ]
        for r in range(num_ranks)
    ]


def zb1p_orders(num_ranks: int, num_microbatches: int) -> Orders:
    orders: Orders = []
    for r in range(num_ranks):
        order: list[ComputeAction] = []
        weights_done = 0
        for kind, mb in _one_f_one_b(r, num_ranks, num_microbatches):
            if kind == "F":
                order.append(fwd(r, mb))
                continue
            order.append(bwd_input(r, mb))
            if mb - r >= 0:
                order.append(bwd_weight(r, mb - r))
                weights_done += 1
        order += [bwd_weight(r, mb) for mb in range(weights_done, num_microbatches)]
        orders.append(order)
    return orders
