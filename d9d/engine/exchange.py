"""The training step's side of the static-capacity expert exchange (`d9d.parallel.expert.capacity`).

With `expert_backend: {kind: all_to_all, capacity_factor: f}` the MoE layers' exchanges stop reading their
split sizes to the host once they are calibrated. This guard is what makes that exact:

- the first step runs the reading exchange and records every layer's copies per (source, destination)
  pair of its expert-parallel group; after it every rank sets each pair's capacity to f × its load (the
  largest over the group's replicas; one gather of the loads by layer name, once);
- every later step's exchanges record on the device whether any peer got more copies than the capacity;
  the flag joins the step's loss all-reduce and host read (`global_loss`, `StepValuesRead`), so it costs no
  synchronization of its own;
- a step whose exchange overflowed is not applied (a fused optimizer skips it on the device, others are
  not stepped), each overflowing pair's capacity grows to f × its load and at least `capacity_growth` ×
  its rows, the RNG streams and task metrics go back to where the step began, and the step runs again on
  the same microbatches. Its result equals the reading exchange's; the rerun is logged and counted
  (`exchange_reruns` in the step metrics);
- every `capacity_recalibrate_every` steps each pair's capacity is set to f × its largest load of those
  steps (one host read and one gather, by layer name): it follows the routing down as well as up. The
  largest pair capacity of the reporting rank's layers is the `exchange_capacity_rows` step metric.

The capacities are saved with each rank's checkpoint state (`rank-<r>.pt`, `state_dict`): a resumed run
exchanges, recalibrates and counts reruns exactly as the uninterrupted run, rather than reading its split
sizes on its first step and calibrating anew. A checkpoint written with another `capacity_factor` (or
without the capacity) leaves the run to calibrate on its first step, as a new run does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from d9d.core.context import DistributedContext
from d9d.core.dist_ops import all_gather_object
from d9d.parallel.compile import compiled_blocks_exist, retrace_blocks
from d9d.parallel.expert import ExchangeCapacity
from d9d.parallel.expert.capacity import Loads

RankLoads = dict[str, tuple[int, list[float]]]
"""A rank's loads by MoE layer name: (its rank in the layer's expert-parallel group, copies to each peer)."""


class ExchangeCapacityGuard:
    """Calibrates and grows the static exchange capacities of this rank's MoE layers (each its own), and
    says when a step must run again. Every rank holds one (with no capacities where it has no MoE layer):
    the decisions are collectives."""

    def __init__(self, ctx: DistributedContext, capacities: Sequence[tuple[str, ExchangeCapacity]]) -> None:
        self.ctx = ctx
        self.capacities = list(capacities)
        every = max((c.recalibrate_every or 0 for _, c in self.capacities), default=0)
        flags = torch.tensor([float(bool(self.capacities)), float(every)], device=ctx.device)
        if ctx.is_distributed:
            # once: a pipeline stage may hold no MoE layer, yet takes part in every gather of the loads
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        enabled, every = flags.tolist()
        self.enabled = bool(enabled)
        self.recalibrate_every = int(every) or None
        self.calibrated = False
        self.reruns = 0

    def take(self) -> torch.Tensor | None:
        """This rank's [layers, (overflowed, copies to each peer...)] since the last take, on the device
        (zeros for a layer without a dispatch); None when disabled."""
        if not self.enabled:
            return None
        width = 1 + max((c.peers for _, c in self.capacities), default=1)
        zero = torch.zeros(width, device=self.ctx.device)
        records = [
            torch.cat([r.to(zero.device), zero[r.numel() :]]) if (r := c.take()) is not None else zero
            for _, c in self.capacities
        ]
        return torch.stack(records) if records else zero[None]

    @staticmethod
    def overflowed(records: torch.Tensor) -> torch.Tensor:
        """1 where any layer's exchange overflowed (on the device), else 0."""
        return records[:, 0].amax()

    @property
    def largest_rows(self) -> int:
        """This rank's largest pair capacity in rows (0 before calibration)."""
        return max((c.largest for _, c in self.capacities), default=0)

    def _everyone(self, mine: RankLoads) -> list[RankLoads]:
        """Each rank's loads by layer name (ranks of other pipeline stages hold other layers; the ranks of one
        expert group hold the same ones)."""
        return all_gather_object(mine) if self.ctx.is_distributed else [mine]

    def _pairs(self, capacity: ExchangeCapacity, name: str, everyone: list[RankLoads]) -> Loads | None:
        """The layer's copies by (source, destination): each source's largest over the expert-parallel
        replicas (other data-parallel groups run the same layer on other tokens); None when no rank saw it."""
        seen = [loads[name] for loads in everyone if name in loads]
        if not seen:
            return None
        pairs = [[0.0] * capacity.peers for _ in range(capacity.peers)]
        for source, loads in seen:
            pairs[source] = [max(a, b) for a, b in zip(pairs[source], loads[: capacity.peers], strict=True)]
        return pairs

    def _span(self) -> str:
        if not self.capacities:
            return "-"
        return f"{min(c.smallest for _, c in self.capacities)}-{self.largest_rows}"

    def settle(self, step: int, records: torch.Tensor, overflowed: bool) -> bool:
        """After the step's values were read (`overflowed` is global, so every rank gets here alike):
        calibrate after the first step, grow after an overflow, recalibrate every `recalibrate_every`
        steps. True when the step must run again."""
        if self.calibrated and not overflowed:
            if self.recalibrate_every is not None and step % self.recalibrate_every == 0:
                self._recalibrate(step)
            return False
        # Rare (the first step, an overflow): each layer's loads of this step on every rank.
        loads = records[:, 1:].tolist()
        mine = {name: (c.rank, loads[i]) for i, (name, c) in enumerate(self.capacities)}
        everyone = self._everyone(mine)
        for name, capacity in self.capacities:
            pairs = self._pairs(capacity, name, everyone)
            assert pairs is not None  # this rank's own loads are among them
            if self.calibrated:
                capacity.grow(pairs)
            else:
                capacity.fit(pairs)
                capacity.take_window()  # the first window begins with the calibrated capacities
        if not self.calibrated:
            # The blocks compiled at the first step end their graphs at each MoE layer (the reading exchange
            # breaks them there); calibrated, the exchange is traceable, so the blocks trace again, whole.
            retrace_blocks()
        self.reruns += overflowed
        if self.ctx.is_main_process and overflowed:
            self.ctx.logger.warning(
                "step %d: an expert exchange overflowed its capacity; capacities now %s rows per pair "
                "(source, destination) and the step runs again (%d reruns so far)",
                step,
                self._span(),
                self.reruns,
            )
        elif self.ctx.is_main_process:
            self.ctx.logger.info(
                "expert exchange capacities: %s rows per pair (source, destination; from step %d's loads); "
                "dispatches no longer read their split sizes%s",
                self._span(),
                step,
                # the retrace is a compile of the whole block with symbolic sizes: ~60 s on the benchmark MoE
                "; compiled blocks now trace again with the exchange inside (one longer compile)"
                if compiled_blocks_exist()
                else "",
            )
        self.calibrated = True
        return overflowed

    def state_dict(self) -> dict[str, Any]:
        return {
            "calibrated": self.calibrated,
            "reruns": self.reruns,
            "layers": {name: c.state_dict() for name, c in self.capacities},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the capacities (the per-rank state of the same world size, so of the same layers). Every
        rank decides alike: the checkpoint and the configuration are the same on all."""
        layers = state["layers"]
        mine = {name for name, _ in self.capacities}
        try:
            if set(layers) != mine:
                raise ValueError(f"saved for MoE layers {sorted(layers)}, this rank holds {sorted(mine)}")
            for name, capacity in self.capacities:
                capacity.load_state_dict(layers[name], self.ctx.device)
        except ValueError as e:
            for _, capacity in self.capacities:  # nothing half-restored
                capacity.reset()
            if self.ctx.is_main_process:
                self.ctx.logger.info("expert exchange capacities not restored (%s): calibrating anew", e)
            return
        self.calibrated = bool(state["calibrated"])
        self.reruns = int(state["reruns"])

    def _recalibrate(self, step: int) -> None:
        windows = [(name, c, w) for name, c in self.capacities if (w := c.take_window()) is not None]
        loads = torch.stack([w for _, _, w in windows]).tolist() if windows else []
        everyone = self._everyone(
            {name: (c.rank, window) for (name, c, _), window in zip(windows, loads, strict=True)}
        )
        before = self._span()
        for name, capacity in self.capacities:
            pairs = self._pairs(capacity, name, everyone)
            if (
                pairs is not None
            ):  # a layer without a dispatch since the last recalibration keeps its capacity
                capacity.fit(pairs)
        if self.ctx.is_main_process:
            self.ctx.logger.info(
                "step %d: expert exchange capacities recalibrated from the last %d steps' loads: %s -> %s "
                "rows per pair (source, destination)",
                step,
                self.recalibrate_every,
                before,
                self._span(),
            )
