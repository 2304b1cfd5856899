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
skips the update on the device, grows the layer's `rows` — to `factor` × the largest load seen, and at
least `growth` × its rows, so a load that keeps rising (routing early in training) overflows a few times,
not every step — and runs the step again. Every `recalibrate_every` steps the loop sets `rows` to `factor` ×
the largest load of those steps, which also shrinks a capacity that the first steps' unbalanced routing made
large (`d9d.engine.exchange`; docs/parallelism.md, "Exchange capacity").
"""

from __future__ import annotations

import math

import torch

ALIGN = 64
"""Rows per peer are a multiple of this by default."""
GROWTH = 1.5
"""After an overflow the rows grow to at least this × what they were, by default."""


class ExchangeCapacity:
    """One MoE layer's per-peer capacity in rows (None until calibrated) and its load record."""

    def __init__(
        self,
        factor: float,
        *,
        align: int = ALIGN,
        growth: float = GROWTH,
        recalibrate_every: int | None = None,
    ) -> None:
        if factor < 1:
            raise ValueError(f"capacity factor {factor} must be >= 1 (headroom over the largest load seen)")
        if growth < 1:
            raise ValueError(f"capacity growth {growth} must be >= 1")
        self.factor = factor
        self.align = align
        self.growth = growth
        self.recalibrate_every = recalibrate_every
        self.rows: int | None = None
        # [overflowed (0/1), largest copies sent to one peer] since the last `take`, on the device
        self._record: torch.Tensor | None = None
        # the largest copies sent to one peer since the last `take_window`, on the device
        self._window: torch.Tensor | None = None

    def record(self, per_peer: torch.Tensor, rows: int | None) -> None:
        """Note one dispatch's copies per peer ([peers], on the device), sent with `rows` per peer (None:
        sizes read from the counts, nothing can overflow). No host synchronization."""
        largest = per_peer.max().float()
        overflowed = largest > rows if rows is not None else torch.zeros_like(largest)
        seen = torch.stack([overflowed.float(), largest])
        self._record = seen if self._record is None else torch.maximum(self._record, seen)

    def take(self) -> torch.Tensor | None:
        """[overflowed, largest load] since the last take (None without a dispatch), then clear it. With
        `recalibrate_every` set the load also joins the window that `take_window` returns."""
        record, self._record = self._record, None
        if record is not None and self.recalibrate_every is not None:  # else no kernel per layer and step
            self._window = record[1] if self._window is None else torch.maximum(self._window, record[1])
        return record

    def take_window(self) -> torch.Tensor | None:
        """The largest load of the steps taken since the last call (None without a dispatch); clears it."""
        window, self._window = self._window, None
        return window

    def _aligned(self, rows: float) -> int:
        return max(math.ceil(rows / self.align) * self.align, self.align)

    def fit(self, largest_load: float) -> None:
        """Room for `largest_load` copies per peer times `factor` (calibration and recalibration: it may
        shrink)."""
        self.rows = self._aligned(largest_load * self.factor)

    def grow(self, largest_load: float) -> None:
        """After an overflow: room for `largest_load` times `factor`, and at least `growth` × the rows."""
        grown = self._aligned((self.rows or 0) * self.growth)
        self.rows = max(self._aligned(largest_load * self.factor), grown)
