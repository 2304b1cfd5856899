"""The differentiable exchange of context parallelism: every rank's keys/values, in sequence order.

Forward all-gathers the local shards; backward reduce-scatters the gradient, because every rank's queries
attended to every rank's keys, so a key's gradient is the sum of the contributions of all ranks and lands
on the rank that owns the key.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from d9d.parallel.context.layout import ContextParallelGroup, gathered_order


def _all_gather_front(x: torch.Tensor, size: int, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_front(x: torch.Tensor, size: int, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, cp: ContextParallelGroup) -> torch.Tensor:
        ctx.dim, ctx.cp = dim, cp
        gathered = _all_gather_front(x.movedim(dim, 0), cp.size, cp.group)
        order = gathered_order(gathered.shape[0], cp.size, x.device)
        ctx.order = order  # an index, never differentiated (and cached, so not saved as an activation)
        return gathered.index_select(0, order).movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        order: torch.Tensor = ctx.order
        cp: ContextParallelGroup = ctx.cp
        in_order = grad.movedim(ctx.dim, 0)
        rank_major = torch.empty_like(in_order)
        rank_major.index_copy_(0, order, in_order)  # undo the forward's reordering
        local = _reduce_scatter_front(rank_major, cp.size, cp.group)
        return local.movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, cp: ContextParallelGroup, dim: int) -> torch.Tensor:
    """Every rank's shard of `x` along `dim`, concatenated in sequence order; gradients are summed back onto
    the owning rank's shard."""
    out: torch.Tensor = _GatherSequence.apply(x, dim, cp)
    return out
