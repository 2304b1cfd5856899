"""Combine metric states across the ranks of a process group.

States that reduce the same way and share a dtype and device travel in one flat buffer, so a collection
of twenty scalar metrics costs one all-reduce, not twenty. "cat" states (non-additive data such as raw
samples) are all-gathered with their per-rank shapes and concatenated in rank order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from d9d.core import PendingResult, all_gather_varshape_async
from d9d.metrics.state import MetricState

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def group_world_size(group: dist.ProcessGroup | None) -> int:
    """1 when there is nothing to sync with: no process group at all, or a group of one."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    if group is not None and not isinstance(group, dist.ProcessGroup):  # new_group's non-member marker
        raise ValueError(f"rank {dist.get_rank()} is not a member of the metric sync group")
    return dist.get_world_size(group)


def sync_states(states: Sequence[MetricState], group: dist.ProcessGroup | None = None) -> None:
    """Replace each state's local value by its combination over `group`; every member gets the result.

    Collective: every rank of `group` must call it with states of the same names, reductions and (for
    non-"cat" states) shapes, in the same order.
    """
    if group_world_size(group) == 1:
        return
    buckets: dict[tuple[str, torch.dtype, torch.device], list[MetricState]] = {}
    gathered: list[MetricState] = []
    for state in states:
        if state.reduction == "cat":
            gathered.append(state)
        else:
            key = (state.reduction, state.value.dtype, state.value.device)
            buckets.setdefault(key, []).append(state)

    reduced: list[tuple[dist.Work | None, torch.Tensor, list[MetricState]]] = []
    for (reduction, _, _), bucket in buckets.items():
        flat = torch.cat([s.value.detach().reshape(-1) for s in bucket])
        work = dist.all_reduce(flat, op=_OPS[reduction], group=group, async_op=True)
        reduced.append((work, flat, bucket))
    pieces: list[tuple[MetricState, PendingResult[list[torch.Tensor]]]] = [
        (s, all_gather_varshape_async(s.value.detach().contiguous(), group)) for s in gathered
    ]

    for work, flat, bucket in reduced:
        if work is not None:
            work.wait()
        offset = 0
        for state in bucket:
            numel = state.value.numel()
            state.value = flat[offset : offset + numel].reshape(state.value.shape).clone()
            offset += numel
    for state, pending in pieces:
        state.value = torch.cat(pending.wait(), dim=0)
