"""The training step's side of the static-capacity expert exchange (`d9d.parallel.expert.capacity`).

With `expert_backend: {kind: all_to_all, capacity_factor: f}` the MoE layers' exchanges stop reading their
split sizes to the host once they are calibrated. This guard is what makes that exact:

- the first step runs the reading exchange and records the largest per-peer load of every layer; after it
  every rank sets the same capacity, f × the largest load any rank saw (one all-reduce, once);
- every later step's exchanges record on the device whether any peer got more copies than the capacity;
  the flag joins the step's loss all-reduce and host read (`global_loss`, `StepValuesRead`), so it costs no
  synchronization of its own;
- a step whose exchange overflowed is not applied (a fused optimizer skips it on the device, others are
  not stepped), the capacity grows to f × the largest load seen, the RNG streams and task metrics go back
  to where the step began, and the step runs again on the same microbatches. Its result equals the reading
  exchange's; the rerun is logged and counted (`exchange_reruns` in the step metrics).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from d9d.core.context import DistributedContext
from d9d.parallel.expert import ExchangeCapacity, take_exchange_records


class ExchangeCapacityGuard:
    """Calibrates and grows the static exchange capacities of this rank's MoE layers, and says when a step
    must run again. Every rank holds one (with no capacities where it has no MoE layer): the decisions
    are collectives."""

    def __init__(self, ctx: DistributedContext, capacities: Sequence[ExchangeCapacity]) -> None:
        self.ctx = ctx
        self.capacities = list(capacities)
        flag = torch.tensor([float(bool(self.capacities))], device=ctx.device)
        if ctx.is_distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # once: a pipeline stage may hold no MoE layer
        self.enabled = bool(flag.item())
        self.calibrated = False
        self.reruns = 0

    def take(self) -> torch.Tensor | None:
        """This rank's [overflowed, largest load] since the last take, on the device; None when disabled."""
        if not self.enabled:
            return None
        return take_exchange_records(self.capacities, self.ctx.device)

    def settle(self, step: int, record: torch.Tensor, overflowed: bool) -> bool:
        """After the step's values were read (`overflowed` is global, so every rank gets here alike):
        calibrate after the first step, grow after an overflow. True when the step must run again."""
        if self.calibrated and not overflowed:
            return False
        largest = record[1:].clone()
        if self.ctx.is_distributed:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        load = float(largest.item())
        for capacity in self.capacities:
            capacity.fit(load)
        rows = max((c.rows or 0 for c in self.capacities), default=0)
        if overflowed:
            self.reruns += 1
        if overflowed and self.ctx.is_main_process:
            self.ctx.logger.warning(
                "step %d: an expert exchange overflowed its capacity (a peer was to get %d copies); the "
                "capacity is now %d rows per peer and the step runs again (%d reruns so far)",
                step,
                int(load),
                rows,
                self.reruns,
            )
        elif self.ctx.is_main_process:
            self.ctx.logger.info(
                "expert exchange capacity: %d rows per peer (largest load of step %d: %d copies); "
                "dispatches no longer read their split sizes",
                rows,
                step,
                int(load),
            )
        self.calibrated = True
        return overflowed
