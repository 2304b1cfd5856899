"""Expert-parallel token exchange through DeepEP's NVLink/RDMA kernels (CUDA only, bf16 activations).

DeepEP sends each token once to every rank hosting at least one of its experts (not once per expert),
with the routing of that token translated to local expert ids (-1 for experts elsewhere). This handler
expands the received tokens into one row per (token, local expert) grouped by expert, and on the way
back sums a token's rows locally before DeepEP's combine sums across ranks. DeepEP kernels are not
differentiable, so both directions are wrapped: the backward of dispatch is a combine and the backward
of combine is a cached-layout dispatch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from d9d.modules.moe.communication import DispatchedTokens, RoutedTokens


def deep_ep_available() -> bool:
    """Whether `deep_ep` can be imported here (it is an optional, CUDA-only dependency)."""
    try:
        importlib.import_module("deep_ep")
    except ImportError:
        return False
    return True


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        buffer: Any,
        num_experts: int,
        handle_out: list[Any],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_ids, num_experts)
        recv_x, recv_ids, recv_weights, _, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_ids,
            topk_weights=topk_weights,
        )
        ctx.buffer = buffer
        ctx.handle = handle
        handle_out.append(handle)
        ctx.mark_non_differentiable(recv_ids)
        return recv_x, recv_weights, recv_ids

    @staticmethod
    def backward(
        ctx: Any, grad_x: torch.Tensor, grad_weights: torch.Tensor, _grad_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        x, weights, _ = ctx.buffer.combine(
            grad_x.contiguous(), ctx.handle, topk_weights=grad_weights.contiguous()
        )
        return x, weights, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, buffer: Any, handle: Any) -> torch.Tensor:
        ctx.buffer = buffer
        ctx.handle = handle
        out, _, _ = buffer.combine(x.contiguous(), handle)
        return out  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x, _, _, _, _, _ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return grad_x, None, None


@dataclass(frozen=True)
class _DeepEPState:
    handle: Any
    token_of_row: torch.Tensor  # [rows]: received token each row came from
    row_weights: torch.Tensor  # [rows]: routing weight of each row
    num_received: int


class DeepEPMoECommunication:
    """`MoECommunication` over DeepEP's normal (high-throughput) kernels. The buffer is sized lazily for
    the hidden size of the first dispatch and grown when a larger one arrives."""

    def __init__(self, group: dist.ProcessGroup, *, num_sms: int | None = None) -> None:
        self._deep_ep = importlib.import_module("deep_ep")
        if num_sms is not None:
            self._deep_ep.Buffer.set_num_sms(num_sms)
        self.group = group
        self.size = dist.get_world_size(group)
        self._buffer: Any = None

    def _buffer_for(self, hidden_bytes: int) -> Any:
        buffer_cls = self._deep_ep.Buffer
        nvl, rdma = 0, 0
        for config in (buffer_cls.get_dispatch_config(self.size), buffer_cls.get_combine_config(self.size)):
            nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, self.size))
            rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, self.size))
        current = self._buffer
        if current is None or current.num_nvl_bytes < nvl or current.num_rdma_bytes < rdma:
            self._buffer = buffer_cls(self.group, nvl, rdma)
        return self._buffer

    def dispatch(self, routed: RoutedTokens) -> DispatchedTokens:
        hidden_states = routed.hidden_states
        if hidden_states.dtype != torch.bfloat16:
            raise TypeError(
                f"DeepEP dispatch needs bfloat16 activations, got {hidden_states.dtype}; use the all_to_all "
                "expert-parallel backend for other dtypes"
            )
        local_experts = routed.local_experts(self.size)
        buffer = self._buffer_for(hidden_states.shape[1] * hidden_states.element_size())
        handles: list[Any] = []
        recv_x, recv_weights, recv_ids = _Dispatch.apply(
            hidden_states,
            routed.topk_weights.float(),
            routed.topk_ids.long(),
            buffer,
            routed.num_experts,
            handles,
        )
        k = recv_ids.shape[1]
        flat_ids = recv_ids.reshape(-1)
        selected = (flat_ids >= 0).nonzero().squeeze(1)
        order = torch.argsort(flat_ids[selected], stable=True)
        slots = selected[order]  # (token, k) slots grouped by local expert
        token_of_row = slots // k
        state = _DeepEPState(handles[0], token_of_row, recv_weights.reshape(-1)[slots], recv_x.shape[0])
        return DispatchedTokens(
            hidden_states=recv_x[token_of_row],
            tokens_per_expert=torch.bincount(flat_ids[selected], minlength=local_experts),
            state=state,
        )

    def combine(self, expert_outputs: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        state: _DeepEPState = dispatched.state
        weighted = expert_outputs * state.row_weights[:, None].to(expert_outputs.dtype)
        per_token = expert_outputs.new_zeros(state.num_received, expert_outputs.shape[1])
        per_token = per_token.index_add(0, state.token_of_row, weighted)
        out: torch.Tensor = _Combine.apply(per_token.to(torch.bfloat16), self._buffer, state.handle)
        return out.to(expert_outputs.dtype)
