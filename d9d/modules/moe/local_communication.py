"""The default MoE communication: every expert is local, dispatch is a sort by expert id."""

from __future__ import annotations

import torch

from d9d.modules.moe.communication import DispatchedTokens
from d9d.modules.moe.counting import tokens_per_expert


class LocalMoECommunication:
    """Dispatch copies each token once per selected expert and sorts the copies by expert (stable, so
    copies of one expert keep token order); combine scatter-adds them back into their tokens."""

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        num_experts: int,
    ) -> DispatchedTokens:
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        source_token = order // topk_ids.shape[1]
        return DispatchedTokens(
            hidden_states=hidden_states[source_token],
            tokens_per_expert=tokens_per_expert(flat_ids, num_experts),
            row_weights=topk_weights.reshape(-1)[order],
            state=(source_token, hidden_states.shape[0]),
        )

    def combine(self, expert_outputs: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        source_token, num_tokens = dispatched.state
        out = expert_outputs.new_zeros(num_tokens, expert_outputs.shape[1])
        return out.index_add(0, source_token, expert_outputs)
