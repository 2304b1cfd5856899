"""The training step's side of the static-capacity expert exchange (`d9d.parallel.expert.capacity`).

With `expert_backend: {kind: all_to_all, capacity_factor: f}` the MoE layers' exchanges stop reading their
split sizes to the host once they are calibrated. This guard is what makes that exact:

- the first step runs the reading exchange and records the largest per-peer load of every layer; after it
  every rank sets each layer's capacity to f × the largest load any rank saw in that layer (one gather of
  the loads by layer name, once);
- every later step's exchanges record on the device whether any peer got more copies than the capacity;
  the flag joins the step's loss all-reduce and host read (`global_loss`, `StepValuesRead`), so it costs no
  synchronization of its own;
- a step whose exchange overflowed is not applied (a fused optimizer skips it on the device, others are
  not stepped), each layer's capacity grows to f × its largest load seen and at least `capacity_growth` ×
  its rows, the RNG streams and task metrics go back to where the step began, and the step runs again on
  the same microbatches. Its result equals the reading exchange's; the rerun is logged and counted
  (`exchange_reruns` in the step metrics);
- every `capacity_recalibrate_every` steps each layer's capacity is set to f × the largest load of those
  steps (one host read and one gather, by layer name): it follows the routing down as well as up. The
  largest capacity of the reporting rank's layers is the `exchange_capacity_rows` step metric.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from d9d.core.context import DistributedContext
from d9d.core.dist_ops import all_gather_object
from d9d.parallel.expert import ExchangeCapacity


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
        """This rank's [layers, (overflowed, largest load)] since the last take, on the device (zeros for a
        layer without a dispatch); None when disabled."""
        if not self.enabled:
            return None
        zero = torch.zeros(2, device=self.ctx.device)
        records = [r.to(zero.device) if (r := c.take()) is not None else zero for _, c in self.capacities]
        return torch.stack(records) if records else zero[None]

    @staticmethod
    def overflowed(records: torch.Tensor) -> torch.Tensor:
        """1 where any layer's exchange overflowed (on the device), else 0."""
        return records[:, 0].amax()

    @property
    def largest_rows(self) -> int:
        """This rank's largest capacity in rows per peer (0 before calibration)."""
        return max((c.rows or 0 for _, c in self.capacities), default=0)

    def _everyone(self, mine: dict[str, float]) -> list[dict[str, float]]:
        """Each rank's loads by layer name (ranks of other pipeline stages hold other layers; the ranks of one
        expert group hold the same ones)."""
        return all_gather_object(mine) if self.ctx.is_distributed else [mine]

    def _span(self) -> str:
        rows = [c.rows or 0 for _, c in self.capacities]
        return f"{min(rows)}-{max(rows)}" if rows else "-"

    def settle(self, step: int, records: torch.Tensor, overflowed: bool) -> bool:
        """After the step's values were read (`overflowed` is global, so every rank gets here alike):
        calibrate after the first step, grow after an overflow, recalibrate every `recalibrate_every`
        steps. True when the step must run again."""
        if self.calibrated and not overflowed:
            if self.recalibrate_every is not None and step % self.recalibrate_every == 0:
                self._recalibrate(step)
            return False
        # Rare (the first step, an overflow): each layer's largest load of this step on every rank.
        mine = dict(zip((n for n, _ in self.capacities), records[:, 1].tolist(), strict=False))
        everyone = self._everyone(mine)
        for name, capacity in self.capacities:
            load = max(loads.get(name, 0.0) for loads in everyone)
            if self.calibrated:
                capacity.grow(load)
            else:
                capacity.fit(load)
                capacity.take_window()  # the first window begins with the calibrated capacities
        self.reruns += overflowed
        if self.ctx.is_main_process and overflowed:
            self.ctx.logger.warning(
                "step %d: an expert exchange overflowed its capacity; capacities now %s rows per peer "
                "(by layer) and the step runs again (%d reruns so far)",
                step,
                self._span(),
                self.reruns,
            )
        elif self.ctx.is_main_process:
            self.ctx.logger.info(
                "expert exchange capacities: %s rows per peer (by layer, from step %d's loads); dispatches "
                "no longer read their split sizes",
                self._span(),
                step,
            )
        self.calibrated = True
        return overflowed

    def _recalibrate(self, step: int) -> None:
        windows = [(name, w) for name, c in self.capacities if (w := c.take_window()) is not None]
        loads = torch.stack([w for _, w in windows]).tolist() if windows else []
        everyone = self._everyone(dict(zip((name for name, _ in windows), loads, strict=True)))
        before = self._span()
        for name, capacity in self.capacities:
            seen = [r[name] for r in everyone if name in r]
            if seen:  # a layer without a dispatch since the last recalibration keeps its capacity
                capacity.fit(max(seen))
        if self.ctx.is_main_process:
            self.ctx.logger.info(
                "step %d: expert exchange capacities recalibrated from the last %d steps' loads: %s -> %s "
                "rows per peer (by layer)",
                step,
                self.recalibrate_every,
                before,
                self._span(),
            )
