"""Top-k softmax routing with optional auxiliary-loss-free load balancing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from d9d.modules.checkpointing import is_recomputing
from d9d.modules.moe.counting import tokens_per_expert


@dataclass(frozen=True)
class Routing:
    probs: torch.Tensor  # [tokens, experts] float32 softmax over all experts
    topk_ids: torch.Tensor  # [tokens, k] int64 global expert ids
    topk_weights: torch.Tensor  # [tokens, k] in the input dtype


class TopKRouter(nn.Module):
    """Softmax over experts, then the top-k of them per token.

    - `renormalize`: the k selected probabilities are rescaled to sum to one.
    - `expert_bias` (auxiliary-loss-free balancing, DeepSeek-V3 style): a per-expert bias added to the
      probabilities *for selection only* (weights stay the unbiased probabilities). `update_expert_bias()`
      moves it by `bias_update_rate` towards balance, using the load accumulated since the last update.
    - `expert_load` accumulates how many token copies each expert received since the last
      `update_expert_bias()` / `reset_expert_load()`; the engine logs it (and all-reduces it across data-
      parallel ranks before updating the bias, so every replica keeps the same bias).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool = True,
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.bias_update_rate = bias_update_rate
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.expert_bias: torch.Tensor | None
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.expert_load: torch.Tensor
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.expert_load.zero_()

    def forward(self, x: torch.Tensor) -> Routing:
        """`x` [tokens, hidden] → routing decisions."""
        logits = x @ self.weight.t()
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.expert_bias is None:
            topk_probs, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        else:
            _, topk_ids = torch.topk(probs + self.expert_bias, self.top_k, dim=-1)
            topk_probs = probs.gather(1, topk_ids)
        if self.renormalize:
            topk_probs = topk_probs / topk_probs.sum(dim=-1, keepdim=True)
        if not is_recomputing():
            with torch.no_grad():
                self.expert_load += tokens_per_expert(topk_ids, self.num_experts)
        return Routing(probs=probs, topk_ids=topk_ids, topk_weights=topk_probs.to(logits.dtype))

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Raises the bias of under-loaded experts and lowers over-loaded ones by `bias_update_rate`, then
        clears the accumulated load. A no-op on the bias (but still clears the load) when disabled."""
        if self.expert_bias is not None:
            load = self.expert_load
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.expert_load.zero_()

    @torch.no_grad()
    def reset_expert_load(self) -> None:
        self.expert_load.zero_()
