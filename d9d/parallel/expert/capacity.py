"""A static per-peer capacity for the expert exchange, so a dispatch needs no host synchronization.

Without it every dispatch reads the split sizes to the host (`all_to_all_single` takes them as Python
ints): the host blocks until the GPU has caught up to that layer, cannot queue work ahead, and the GPU then
waits for its launches (docs/benchmarks.md, the FSDP 4 × EP 4 profile: ~75 ms of host syncs and ~135 ms of
idle GPU per step). With a capacity every rank sends each peer exactly `rows` rows (the copies bound for
it, then zero padding), a size every rank of the group knows without looking at the counts.

The capacity is calibrated, not guessed: until `rows` is set the exchange reads the split sizes as before
and only records the largest per-peer load; the training loop then sets each layer's `rows`, the same on
every rank, to `factor` × the largest load any rank saw in that layer (rounded up to `align` rows). From
then on a peer that should get more copies than `rows` is an *overflow*: the copies past it are not sent
and the step's result is wrong. It is never silent: each exchange records on the device whether it
overflowed and its largest load; the loop reads the flag with the step's loss (no extra synchronization),
skips the update on the device, grows the layer's `rows` to the largest load seen (times `factor` again)
and runs the step again (`d9d.engine.exchange`; docs/parallelism.md, "Exchange capacity").
"""

from __future__ import annotations

import math

import torch

ALIGN = 64
"""Rows per peer are a multiple of this by default."""


class ExchangeCapacity:
    """One MoE layer's per-peer capacity in rows (None until calibrated) and its load record."""

    def __init__(self, factor: float, *, align: int = ALIGN) -> None:
        if factor < 1:
            raise ValueError(f"capacity factor {factor} must be >= 1 (headroom over the largest load seen)")
        self.factor = factor
        self.align = align
        self.rows: int | None = None
        # [overflowed (0/1), largest copies sent to one peer] since the last `take`, on the device
        self._record: torch.Tensor | None = None

    def record(self, per_peer: torch.Tensor, rows: int | None) -> None:
        """Note one dispatch's copies per peer ([peers], on the device), sent with `rows` per peer (None:
        sizes read from the counts, nothing can overflow). No host synchronization."""
        largest = per_peer.max().float()
        overflowed = largest > rows if rows is not None else torch.zeros_like(largest)
        seen = torch.stack([overflowed.float(), largest])
        self._record = seen if self._record is None else torch.maximum(self._record, seen)

    def take(self) -> torch.Tensor | None:
        """[overflowed, largest load] since the last take (None without a dispatch), then clear it."""
        record, self._record = self._record, None
        return record

    def fit(self, largest_load: float) -> None:
        """Room for `largest_load` copies per peer times `factor`; never shrinks."""
        rows = max(math.ceil(largest_load * self.factor / self.align) * self.align, self.align)
        self.rows = rows if self.rows is None else max(self.rows, rows)
