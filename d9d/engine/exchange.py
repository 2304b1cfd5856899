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
  not stepped), each layer's capacity grows to f × its largest load seen, the RNG streams and task
  metrics go back to where the step began, and the step runs again on the same microbatches. Its result
  equals the reading exchange's; the rerun is logged and counted (`exchange_reruns` in the step metrics).
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
        flag = torch.tensor([float(bool(self.capacities))], device=ctx.device)
        if ctx.is_distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # once: a pipeline stage may hold no MoE layer
        self.enabled = bool(flag.item())
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

    def settle(self, step: int, records: torch.Tensor, overflowed: bool) -> bool:
        """After the step's values were read (`overflowed` is global, so every rank gets here alike):
        calibrate after the first step, grow after an overflow. True when the step must run again."""
        if self.calibrated and not overflowed:
            return False
        # Rare (the first step, an overflow): each layer's largest load on every rank, by layer name (ranks
        # of other pipeline stages hold other layers; the ranks of one expert group hold the same ones).
        mine = dict(zip((n for n, _ in self.capacities), records[:, 1].tolist(), strict=False))
        everyone = all_gather_object(mine) if self.ctx.is_distributed else [mine]
        for name, capacity in self.capacities:
            capacity.fit(max(loads.get(name, 0.0) for loads in everyone))
        rows = [c.rows or 0 for _, c in self.capacities]
        span = f"{min(rows)}-{max(rows)}" if rows else "-"
        self.reruns += overflowed
        if self.ctx.is_main_process and overflowed:
            self.ctx.logger.warning(
                "step %d: an expert exchange overflowed its capacity; capacities now %s rows per peer "
                "(by layer) and the step runs again (%d reruns so far)",
                step,
                span,
                self.reruns,
            )
        elif self.ctx.is_main_process:
            self.ctx.logger.info(
                "expert exchange capacities: %s rows per peer (by layer, from step %d's loads); dispatches "
                "no longer read their split sizes",
                span,
                step,
            )
        self.calibrated = True
        return overflowed
