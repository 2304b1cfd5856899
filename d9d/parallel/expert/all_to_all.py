"""Expert-parallel token exchange over `torch.distributed.all_to_all_single` (gloo and NCCL).

Experts are split evenly over the `ep` ranks: rank r owns global experts [r·L, (r+1)·L), L = E / ep.
Dispatch sorts the token copies by global expert (so they are grouped by destination rank, then by
expert), exchanges the per-expert counts (one small all-to-all), sends the copies and their routing
weights, and regroups what arrived (source-rank major) into local-expert-major order. Combine runs the
same path backwards and scatter-adds each copy into its source token. Every step is differentiable: the
all-to-all's backward is the reverse all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from d9d.modules.moe.communication import DispatchedTokens


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable `all_to_all_single` along dim 0 with per-rank row counts."""
    out: torch.Tensor = _AllToAll.apply(x, output_splits, input_splits, group)
    return out


@dataclass(frozen=True)
class _AllToAllState:
    source_token: torch.Tensor  # [sent rows]: token index of each sent copy, in send order
    regroup: torch.Tensor  # [received rows]: received row feeding each local-expert-major row
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int


class AllToAllMoECommunication:
    """`MoECommunication` over an expert-parallel process group with plain all-to-all collectives."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        num_experts: int,
    ) -> DispatchedTokens:
        if num_experts % self.size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel size {self.size}"
            )
        local_experts = num_experts // self.size
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        source_token = order // topk_ids.shape[1]
        send_counts = torch.bincount(flat_ids, minlength=num_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [src rank, local expert]
        counts = torch.stack([send_counts, recv_counts]).view(2, self.size, local_experts).sum(2).cpu()
        send_splits, recv_splits = counts[0].tolist(), counts[1].tolist()
        rows = all_to_all(hidden_states[source_token], recv_splits, send_splits, self.group)
        weights = all_to_all(topk_weights.reshape(-1)[order], recv_splits, send_splits, self.group)
        per_source = recv_counts.view(self.size, local_experts)
        expert_of_row = torch.repeat_interleave(
            torch.arange(local_experts, device=flat_ids.device).repeat(self.size), per_source.reshape(-1)
        )
        regroup = torch.argsort(expert_of_row, stable=True)
        state = _AllToAllState(source_token, regroup, send_splits, recv_splits, hidden_states.shape[0])
        return DispatchedTokens(
            hidden_states=rows[regroup],
            tokens_per_expert=per_source.sum(0),
            row_weights=weights[regroup],
            state=state,
        )

    def combine(self, expert_outputs: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        state: _AllToAllState = dispatched.state
        received_order = torch.empty_like(state.regroup)
        received_order[state.regroup] = torch.arange(state.regroup.numel(), device=state.regroup.device)
        back = all_to_all(expert_outputs[received_order], state.send_splits, state.recv_splits, self.group)
        out = back.new_zeros(state.num_tokens, back.shape[1])
        return out.index_add(0, state.source_token, back)
