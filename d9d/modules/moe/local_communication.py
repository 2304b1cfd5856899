"""The default MoE communication: every expert is local, dispatch is a permutation by expert id."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d9d.kernels.backend import KernelBackend
from d9d.kernels.moe import combine_tokens, expert_permutation, permute_tokens
from d9d.modules.moe.communication import (
    DispatchedTokens,
    ExpertsFn,
    RoutedTokens,
    SharedFn,
    sequential_exchange,
)


@dataclass(frozen=True)
class _LocalState:
    slot_rows: torch.Tensor  # [tokens, k]: buffer row of each copy
    weights: torch.Tensor  # [tokens, k]: routing weights


class LocalMoECommunication:
    """Dispatch writes each token once per selected expert into an expert-grouped buffer (stable sort by
    expert, groups starting at multiples of `align`); combine gathers a token's k rows and sums them
    weighted. Both are custom ops (Triton on CUDA), deterministic and free of host syncs."""

    def __init__(self, *, align: int = 1, backend: KernelBackend = "auto") -> None:
        self.align = align
        self.backend: KernelBackend = backend

    def dispatch(self, routed: RoutedTokens) -> DispatchedTokens:
        perm = expert_permutation(routed.topk_ids, routed.num_experts, align=self.align)
        rows = permute_tokens(routed.hidden_states, perm.slot_rows, perm.num_rows, backend=self.backend)
        return DispatchedTokens(rows, perm.rows_per_expert, _LocalState(perm.slot_rows, routed.topk_weights))

    def combine(self, expert_outputs: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        state: _LocalState = dispatched.state
        return combine_tokens(expert_outputs, state.slot_rows, weights=state.weights, backend=self.backend)

    def exchange(
        self, routed: RoutedTokens, experts: ExpertsFn, shared: SharedFn | None = None
    ) -> torch.Tensor:
        return sequential_exchange(self, routed, experts, shared)
