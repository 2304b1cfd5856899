"""Per-rank bookkeeping shared by the V-placement schedules (ZBV, DualPipeV).

Chunk 0 of rank r is its way-down stage r, chunk 1 its way-up stage 2p - 1 - r. Each chunk runs its
microbatches in order, so the builder only tracks the next forward and backward per chunk, plus the weight
passes deferred by split backwards (run oldest first).
"""

from __future__ import annotations

from collections import deque

from d9d.pipeline.schedule.actions import Compute, ComputeAction, Overlapped
from d9d.pipeline.schedule.builders.common import bwd, bwd_input, bwd_weight, fwd


class VRankOrder:
    def __init__(self, rank: int, num_ranks: int, num_microbatches: int) -> None:
        self.stages = (rank, 2 * num_ranks - 1 - rank)
        self.num_microbatches = num_microbatches
        self.next_fwd = [0, 0]
        self.next_bwd = [0, 0]
        self.deferred: deque[tuple[int, int]] = deque()
        self.order: list[ComputeAction] = []

    def forwards_left(self) -> bool:
        return min(self.next_fwd) < self.num_microbatches

    def backwards_left(self) -> bool:
        return min(self.next_bwd) < self.num_microbatches

    def forward(self, chunk: int) -> bool:
        """Append the chunk's next forward; False when all its microbatches went forward already."""
        if self.next_fwd[chunk] >= self.num_microbatches:
            return False
        self.order.append(self._take_forward(chunk))
        return True

    def backward(self, chunk: int, *, split: bool = False) -> bool:
        """Append the chunk's next backward (input part only if `split`); False when none has a forward
        yet."""
        if self.next_bwd[chunk] >= self.next_fwd[chunk]:
            return False
        stage, mb = self.stages[chunk], self._take_backward(chunk)
        if split:
            self.order.append(bwd_input(stage, mb))
            self.deferred.append((stage, mb))
        else:
            self.order.append(bwd(stage, mb))
        return True

    def weight(self) -> bool:
        """Append the oldest deferred weight pass; False when none is deferred."""
        if not self.deferred:
            return False
        self.order.append(bwd_weight(*self.deferred.popleft()))
        return True

    def overlapped(self, fwd_chunk: int, bwd_chunk: int) -> None:
        forward = self._take_forward(fwd_chunk)
        stage = self.stages[bwd_chunk]
        self.order.append(Overlapped(forward, bwd(stage, self._take_backward(bwd_chunk))))

    def _take_forward(self, chunk: int) -> Compute:
        mb = self.next_fwd[chunk]
        self.next_fwd[chunk] += 1
        return fwd(self.stages[chunk], mb)

    def _take_backward(self, chunk: int) -> int:
        mb = self.next_bwd[chunk]
        self.next_bwd[chunk] += 1
        return mb
