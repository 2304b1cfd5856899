"""A static capacity per (source, destination) pair for the expert exchange, so a dispatch needs no host
synchronization.

Without it every dispatch reads the split sizes to the host (`all_to_all_single` takes them as Python
ints): the host blocks until the GPU has caught up to that layer, cannot queue work ahead, and the GPU then
waits for its launches (docs/benchmarks.md, the FSDP 4 × EP 4 profile: ~75 ms of host syncs and ~135 ms of
idle GPU per step). With a capacity rank s sends peer d exactly `rows[s][d]` rows (the copies bound for it,
then zero padding), sizes every rank of the group knows without looking at the counts.

The capacity is calibrated, not guessed: until `rows` is set the exchange reads the split sizes as before
and only records each pair's load; the training loop then sets each layer's `rows`, the same on every rank
of the group, to `factor` × the largest load of each pair (over the expert-parallel replicas, rounded up to
`align` rows). From then on a pair with more copies than its rows is an *overflow*: the copies past them are
not sent and the step's result is wrong. It is never silent: each exchange records on the device whether it
overflowed and its loads; the loop reads the flag with the step's loss (no extra synchronization), skips
the update on the device, grows the overflowing pairs' rows — to `factor` × their load, and at least
`growth` × their rows, so a load that keeps rising (routing early in training) overflows a few times, not
every step — tops up the other pairs whose load came within `factor` of their rows, and runs the step
again. Every `recalibrate_every` steps the loop sets `rows` to `factor` ×
the largest loads of those steps, which also shrinks a capacity that the first steps' unbalanced routing
made large (`d9d.engine.exchange`; docs/parallelism.md, "Exchange capacity").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx.experimental.sym_node import DynamicInt

ALIGN = 64
"""Rows per peer are a multiple of this by default."""
GROWTH = 1.5
"""After an overflow the rows grow to at least this × what they were, by default."""


Loads = list[list[float]]
"""One MoE layer's copies by (source rank, destination rank) of its expert-parallel group."""


def _static(record: torch.Tensor) -> torch.Tensor:
    """The load record keeps its memory for the run (updated in place, zeroed by `take`); marked so, a
    graphed block (`compile.mode: reduce-overhead`) may update it in place: inductor's CUDA graphs refuse
    an input mutated in the graph unless its address is static, and would run the whole block ungraphed.
    Unguarded, as parameters are: every layer has its own record and shares the block's one graph."""
    torch._dynamo.mark_static_address(record, guard=False)
    return record


class ExchangeCapacity:
    """One MoE layer's capacity in rows for each (source, destination) pair of its expert-parallel group
    (None until calibrated; the same on every rank of the group), this rank's place in that group, and its
    load record.

    Per pair rather than one number for all: routing that favours some experts loads the peers that host
    them from every source, and one capacity sized for the busiest pair pads every other pair to it (at the
    2.4x imbalance measured after 100 steps, more than twice the rows the reading exchange sends)."""

    def __init__(
        self,
        factor: float,
        *,
        rank: int,
        peers: int,
        align: int = ALIGN,
        growth: float = GROWTH,
        recalibrate_every: int | None = None,
    ) -> None:
        if factor < 1:
            raise ValueError(f"capacity factor {factor} must be >= 1 (headroom over the largest load seen)")
        if growth < 1:
            raise ValueError(f"capacity growth {growth} must be >= 1")
        if not 0 <= rank < peers:
            raise ValueError(f"rank {rank} is not in an expert-parallel group of {peers}")
        self.factor = factor
        self.rank = rank
        self.peers = peers
        self.align = align
        self.growth = growth
        self.recalibrate_every = recalibrate_every
        self.rows: list[list[int]] | None = None  # [source][destination]
        self._symbolic: list[list[int]] = []  # `rows` for tracing (`set_rows`)
        self._splits: dict[torch.device, torch.Tensor] = {}  # `splits_on`, by device
        # [overflowed (0/1), copies sent to each peer...] since the last `take` (largest), on the device
        self._record: torch.Tensor | None = None
        self._dispatched = False  # since the last `take`
        # the copies sent to each peer since the last `take_window` (largest), on the device
        self._window: torch.Tensor | None = None

    def set_rows(self, rows: list[list[int]]) -> None:
        if len(rows) != self.peers or any(len(row) != self.peers for row in rows):
            raise ValueError(f"capacity rows must be {self.peers} x {self.peers}, got {rows}")
        self.rows = [[int(r) for r in row] for row in rows]
        # The same ints as dynamo's `DynamicInt`s, which a traced dispatch reads (`_rows_here`): symbols in
        # the compiled block from its first trace, so layers with other capacities and later capacities
        # (overflow growth, recalibration) reuse its graph. Plain ints would be guarded by value: a
        # recompile per distinct capacity, until the recompile limit sends the block back to eager.
        self._symbolic = [[DynamicInt(r) for r in row] for row in self.rows]
        self._splits = {}

    def _rows_here(self) -> list[list[int]]:
        assert self.rows is not None
        return self._symbolic if torch.compiler.is_compiling() else self.rows

    def send_splits(self) -> list[int]:
        """Rows this rank sends each peer (calibrated only)."""
        return list(self._rows_here()[self.rank])

    def recv_splits(self) -> list[int]:
        """Rows this rank receives from each peer (calibrated only)."""
        return [row[self.rank] for row in self._rows_here()]

    def splits_on(self, device: torch.device) -> torch.Tensor:
        """[(rows sent to each peer, where each one's segment starts), (rows received from each peer, where
        each one's segment starts)] as a [2, 2, peers] tensor on `device`: made once per capacity change,
        from pinned memory without a blocking copy (a dispatch must not wait for the device). Traced (a
        compiled MoE block), the tensor is built in the graph from the ints: a constant, or a few scalars
        once the ints are symbols; no cache or pinned copy inside a graph."""
        if torch.compiler.is_compiling():
            sizes = torch.tensor([self.send_splits(), self.recv_splits()], device=device)
            return torch.stack([sizes, sizes.cumsum(1) - sizes], 1)
        cached = self._splits.get(device)
        if cached is None:
            sent, received = torch.tensor(self.send_splits()), torch.tensor(self.recv_splits())
            host = torch.stack([torch.stack([r, r.cumsum(0) - r]) for r in (sent, received)])
            if device.type == "cuda":
                host = host.pin_memory()
            cached = self._splits[device] = host.to(device, non_blocking=True)
        return cached

    def record(self, per_peer: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Note one dispatch's copies per peer ([peers], on the device), sent with `rows` [peers] rows to each
        (None: sizes read from the counts, nothing can overflow). No host synchronization.

        Into one buffer, updated in place and zeroed by `take`: a traced dispatch then meets the same
        state at every layer and step (a tensor), where `None` at a step's first layer would be a second
        compiled variant of the whole block."""
        loads = per_peer.float()
        overflowed = (loads > rows).any() if rows is not None else torch.zeros((), device=loads.device)
        seen = torch.cat([overflowed.float()[None], loads])
        if self._record is None:  # the first dispatch: the reading exchange, or right after a restore
            self._record = _static(torch.zeros_like(seen))
        self._record.copy_(torch.maximum(self._record, seen))
        self._dispatched = True

    def take(self) -> torch.Tensor | None:
        """[overflowed, copies to each peer] since the last take (the largest; None without a dispatch), then
        clear it. With `recalibrate_every` set the loads also join the window that `take_window` returns."""
        if not self._dispatched or self._record is None:
            return None
        record = self._record.clone()
        self._record.zero_()
        self._dispatched = False
        if self.recalibrate_every is not None:  # else no kernel per layer and step
            self._window = record[1:] if self._window is None else torch.maximum(self._window, record[1:])
        return record

    def take_window(self) -> torch.Tensor | None:
        """The largest copies to each peer over the steps taken since the last call (None without a
        dispatch); clears it."""
        window, self._window = self._window, None
        return window

    def _aligned(self, rows: float) -> int:
        return max(math.ceil(rows / self.align) * self.align, self.align)

    def fit(self, loads: Loads) -> None:
        """Room for each pair's `loads` copies times `factor` (calibration and recalibration: it may
        shrink)."""
        self.set_rows([[self._aligned(load * self.factor) for load in row] for row in loads])

    def grow(self, loads: Loads) -> None:
        """After an overflow: each pair that overflowed gets room for its load times `factor`, and at least
        `growth` × its rows. The others keep theirs, or get room for their load times `factor` where this
        step's load came closer to their rows than that headroom: the step runs again anyway, so topping such
        a pair up now costs no extra run (some padding, and under CUDA graphs a recording of its layer at the
        new sizes), where letting it overflow at a later step costs that step a second run (routing early in
        training moves many pairs at once: on 2 × H200, 7 of 10 steps from initialization overflowed at
        factor 1.25, docs/benchmarks.md session 31). Never shrinks: that is recalibration's."""
        assert self.rows is not None
        self.set_rows(
            [
                [
                    max(self._aligned(load * self.factor), self._aligned(rows * self.growth))
                    if load > rows
                    else max(rows, self._aligned(load * self.factor))
                    for load, rows in zip(load_row, rows_row, strict=True)
                ]
                for load_row, rows_row in zip(loads, self.rows, strict=True)
            ]
        )

    def reset(self) -> None:
        """Back to uncalibrated, nothing recorded."""
        self.rows, self._symbolic, self._splits, self._record, self._window = None, [], {}, None, None
        self._dispatched = False

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to exchange exactly as the uninterrupted one: the rows, the factor they
        were sized with, and the loads since the last recalibration (host lists)."""
        window = None if self._window is None else self._window.tolist()
        return {"factor": self.factor, "peers": self.peers, "rows": self.rows, "window": window}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device) -> None:
        if state["factor"] != self.factor or state["peers"] != self.peers:
            raise ValueError(
                f"saved for capacity_factor={state['factor']} over {state['peers']} peers, this run has "
                f"{self.factor} over {self.peers}"
            )
        if state["rows"] is not None:
            self.set_rows(state["rows"])
            # the record's buffer before the first (traced) dispatch, as a fresh run has it from calibration
            self._record = _static(torch.zeros(1 + self.peers, device=device))
        self._window = None if state["window"] is None else torch.tensor(state["window"], device=device)

    @property
    def largest(self) -> int:
        """The largest pair's rows (0 before calibration)."""
        return max((max(row) for row in self.rows), default=0) if self.rows is not None else 0

    @property
    def smallest(self) -> int:
        return min((min(row) for row in self.rows), default=0) if self.rows is not None else 0
