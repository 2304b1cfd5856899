"""ZBV: zero-bubble schedule on the V placement (rank r holds stages r and 2p - 1 - r), split backward.

With unit costs the first microbatch reaches the turn of the V on the last rank at time p, and comes back to
rank r at 2p - 1 - r, so rank r has exactly 2 (p - r) - 1 forwards of its way-down chunk (chunk 0) to run
before
its way-up chunk (chunk 1) has work. Then:

1. 2 (p - r) - 1 forwards of chunk 0;
2. r pairs (forward chunk 1, forward chunk 0), as the way-up forwards arrive every other slot;
3. p - r rounds of (forward chunk 1, input backward chunk 1, weight): the first gradients come back;
4. steady state while forwards remain: (forward 0, input backward 0, weight, forward 1, input backward 1,
   weight), every step skipped when it has nothing to run;
5. cool-down: (input backward 1, input backward 0, weight): gradients keep flowing first and the weight passes
   fill the gaps while the last ones travel;
6. the deferred weight passes left.

Each rank then idles only p - 1 slots in a step of 6m (the fill of the way down, which no schedule avoids),
holds at most 2p chunk activations (p full stages, the peak of 1F1B's rank 0), and works for any m >= 1
(bubbles vanish relative to the step once m >= 2p).
"""

from __future__ import annotations

from d9d.pipeline.schedule.builders.common import Orders
from d9d.pipeline.schedule.builders.v_rank import VRankOrder


def zbv_orders(num_ranks: int, num_microbatches: int) -> Orders:
    p = num_ranks
    orders: Orders = []
    for r in range(p):
        b = VRankOrder(r, p, num_microbatches)
        for _ in range(2 * (p - r) - 1):
            b.forward(0)
        for _ in range(r):
            b.forward(1)
            b.forward(0)
        for _ in range(p - r):
            b.forward(1)
            b.backward(1, split=True)
            b.weight()
        while b.forwards_left():
            b.forward(0)
            b.backward(0, split=True)
            b.weight()
            b.forward(1)
            b.backward(1, split=True)
            b.weight()
        while b.backwards_left():
            b.backward(1, split=True)
            b.backward(0, split=True)
            b.weight()
        while b.weight():
            pass
        orders.append(b.order)
    return orders
