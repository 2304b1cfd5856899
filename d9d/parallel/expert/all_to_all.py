"""Expert-parallel token exchange over `torch.distributed.all_to_all_single` (gloo and NCCL).

Experts are split evenly over the `ep` ranks: rank r owns global experts [r·L, (r+1)·L), L = E / ep.
Dispatch permutes the token copies by global expert (so they are grouped by destination rank, then by
expert), exchanges the per-expert counts (one small all-to-all), sends the copies, and regroups what
arrived (source-rank major) into local-expert-major order. Combine runs the same path backwards and each
token gathers its k returned copies, weighted by its routing weights (which therefore never travel).
Every step is differentiable: the all-to-all's backward is the reverse all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from d9d.kernels.backend import KernelBackend
from d9d.kernels.moe import combine_tokens, expert_permutation, permute_tokens
from d9d.modules.moe.communication import DispatchedTokens, RoutedTokens


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
    slot_rows: torch.Tensor  # [tokens, k]: send-buffer row of each copy
    weights: torch.Tensor  # [tokens, k]: routing weights, applied where the copies return
    regroup: torch.Tensor  # [received rows]: received row feeding each local-expert-major row
    send_splits: list[int]
    recv_splits: list[int]


class AllToAllMoECommunication:
    """`MoECommunication` over an expert-parallel process group with plain all-to-all collectives."""

    def __init__(self, group: dist.ProcessGroup, *, backend: KernelBackend = "auto") -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.backend: KernelBackend = backend

    # Eager even inside a compiled MoE block: traced by inductor on CUDA, this exchange trained wrong (a
    # dp 2 × ep 2 run left the one-GPU losses at the second step, 1.6e-2 apart after 8; eager, 1e-7), while
    # gloo/CPU inductor was exact. The host sync on the split sizes breaks the graph here anyway.
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def dispatch(self, routed: RoutedTokens) -> DispatchedTokens:
        local_experts = routed.local_experts(self.size)
        perm = expert_permutation(routed.topk_ids, routed.num_experts)
        send = permute_tokens(routed.hidden_states, perm.slot_rows, perm.num_rows, backend=self.backend)
        send_counts = perm.rows_per_expert
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [src rank, local expert]
        counts = torch.stack([send_counts, recv_counts]).view(2, self.size, local_experts).sum(2).cpu()
        send_splits, recv_splits = counts[0].tolist(), counts[1].tolist()
        rows = all_to_all(send, recv_splits, send_splits, self.group)
        per_source = recv_counts.view(self.size, local_experts)
        expert_of_row = torch.repeat_interleave(
            torch.arange(local_experts, device=send_counts.device).repeat(self.size), per_source.reshape(-1)
        )
        regroup = torch.argsort(expert_of_row, stable=True)
        state = _AllToAllState(perm.slot_rows, routed.topk_weights, regroup, send_splits, recv_splits)
        return DispatchedTokens(hidden_states=rows[regroup], tokens_per_expert=per_source.sum(0), state=state)

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def combine(self, expert_outputs: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        state: _AllToAllState = dispatched.state
        received_order = torch.empty_like(state.regroup)
        received_order[state.regroup] = torch.arange(state.regroup.numel(), device=state.regroup.device)
        back = all_to_all(expert_outputs[received_order], state.send_splits, state.recv_splits, self.group)
        return combine_tokens(back, state.slot_rows, weights=state.weights, backend=self.backend)
