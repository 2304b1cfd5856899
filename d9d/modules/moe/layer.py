"""The MoE feed-forward layer: route, dispatch, run experts, weight, combine, plus an optional shared
expert."""

from __future__ import annotations

import torch
from torch import nn

from d9d.modules.checkpointing import is_recomputing
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe.aux_loss import attach_auxiliary_loss, load_balancing_loss
from d9d.modules.moe.communication import MoECommunication
from d9d.modules.moe.experts import GroupedExperts
from d9d.modules.moe.local_communication import LocalMoECommunication
from d9d.modules.moe.router import TopKRouter


class MoELayer(nn.Module):
    """A sparse SwiGLU layer. Where experts live is the communication handler's business (local by default;
    expert parallelism swaps in an all-to-all handler through `communication`).

    Statistics for logging: `gate.expert_load` (token copies per expert, accumulated) and
    `last_aux_loss` (the balancing loss of the latest forward, detached). With `aux_loss_coef > 0` the
    gradient of `aux_loss_coef · aux_loss` is added during backward of every forward call (so once per
    microbatch); the value never appears in the model's outputs.
    """

    def __init__(
        self,
        router: TopKRouter,
        experts: GroupedExperts,
        *,
        communication: MoECommunication | None = None,
        shared_expert: SwiGLU | None = None,
        shared_expert_gate: bool = False,
        aux_loss_coef: float = 0.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.gate = router
        self.experts = experts
        self.communication: MoECommunication = (
            communication if communication is not None else LocalMoECommunication()
        )
        self.shared_expert = shared_expert
        hidden_size = router.weight.shape[1]
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert_gate else None
        if shared_expert_gate and shared_expert is None:
            raise ValueError("shared_expert_gate=True needs a shared_expert")
        self.aux_loss_coef = aux_loss_coef
        # When the training objective is a *sum* over tokens later divided by the global token count (as the
        # engine does), the balancing loss must be summed over tokens too, or it shrinks by that count.
        self.aux_loss_per_token = False
        self.init_std = init_std
        self.last_aux_loss: torch.Tensor | None = None
        if self.shared_expert_gate is not None:  # the injected blocks arrive initialized
            nn.init.normal_(self.shared_expert_gate.weight, std=self.init_std)

    def reset_parameters(self) -> None:
        self.gate.reset_parameters()
        self.experts.reset_parameters()
        if self.shared_expert is not None:
            self.shared_expert.reset_parameters()
        if self.shared_expert_gate is not None:
            nn.init.normal_(self.shared_expert_gate.weight, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [..., hidden] → same shape."""
        flat = x.reshape(-1, x.shape[-1])
        routing = self.gate(flat)
        dispatched = self.communication.dispatch(
            flat, routing.topk_ids, routing.topk_weights, self.gate.num_experts
        )
        rows = self.experts(dispatched.hidden_states, dispatched.tokens_per_expert)
        rows = rows * dispatched.row_weights[:, None].to(rows.dtype)
        out = self.communication.combine(rows, dispatched)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux = load_balancing_loss(routing.probs, routing.topk_ids)
            if not is_recomputing():
                self.last_aux_loss = aux.detach()
            coef = self.aux_loss_coef * (flat.shape[0] if self.aux_loss_per_token else 1)
            out = attach_auxiliary_loss(out, aux, coef)
        return out.view_as(x)
