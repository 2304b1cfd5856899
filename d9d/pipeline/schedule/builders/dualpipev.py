"""DualPipeV (DeepSeek's DualPipe folded onto a V placement: rank r holds stages r and 2p - 1 - r).

Chunk 0 of a rank is its way-down stage r, chunk 1 its way-up stage 2p - 1 - r. The rank runs eight phases:

1. 2 (p - 1 - r) forwards of chunk 0, filling the way down;
2. r + 1 pairs (forward chunk 0, forward chunk 1) as the first microbatches turn around;
3. p - 1 - r rounds of (input backward chunk 1, a weight backward, forward chunk 1): the weight pass fills the
   wait for the next way-up forward;
4. the steady state, m - 2p + 1 + r rounds of two overlapped pairs: forward chunk 0 with backward chunk 1,
   then forward chunk 1 with backward chunk 0, so each pair's communication can hide behind the other's
   compute (the last rank runs its very first pair back to back: its chunk-1 backward feeds its chunk 0);
5. p - 1 - r rounds of (backward chunk 1, overlapped forward chunk 1 with backward chunk 0) as forwards
   run out;
6. r + 1 rounds of (backward chunk 1, backward chunk 0); from the middle round on, backwards are split and
   their weight passes deferred;
7. p - 1 - r rounds of (a deferred weight pass, input backward chunk 0);
8. the r + 1 weight passes still deferred.

Deferred weight passes run oldest first. Needs m >= 2p - 1 so that rank 0's steady state is not negative.
"""

from __future__ import annotations

from d9d.pipeline.schedule.builders.common import Orders
from d9d.pipeline.schedule.builders.v_rank import VRankOrder


def dualpipev_orders(num_ranks: int, num_microbatches: int) -> Orders:
    p, m = num_ranks, num_microbatches
    orders: Orders = []
    for r in range(p):
        b = VRankOrder(r, p, m)
        for _ in range(2 * (p - 1 - r)):
            b.forward(0)
        for _ in range(r + 1):
            b.forward(0)
            b.forward(1)
        for _ in range(p - 1 - r):
            b.backward(1, split=True)
            b.weight()
            b.forward(1)
        for i in range(m - 2 * p + 1 + r):
            if i == 0 and r == p - 1:
                b.forward(0)
                b.backward(1)
            else:
                b.overlapped(0, 1)
            b.overlapped(1, 0)
        for _ in range(p - 1 - r):
            b.backward(1)
            b.overlapped(1, 0)
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            b.backward(1, split=split)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            b.backward(0, split=split)
        for _ in range(p - 1 - r):
            b.weight()
            b.backward(0, split=True)
        for _ in range(r + 1):
            b.weight()
        orders.append(b.order)
    return orders
