"""Top-k routing (softmax or sigmoid scores) with optional auxiliary-loss-free load balancing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from d9d.modules.checkpointing import is_recomputing
from d9d.modules.moe.counting import tokens_per_expert

ScoreFunction = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class Routing:
    probs: torch.Tensor  # [tokens, experts] float32, each row sums to one (what the balancing loss reads)
    topk_ids: torch.Tensor  # [tokens, k] int64 global expert ids
    topk_weights: torch.Tensor  # [tokens, k] in the input dtype


def route_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    score_function: ScoreFunction = "softmax",
    renormalize: bool = True,
    expert_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int | None = None,
    scaling_factor: float = 1.0,
) -> Routing:
    """logits [tokens, experts] → scores → top-k (on scores + `expert_bias` when given; the weights stay
    the unbiased scores) → optional renormalization over the k chosen → times `scaling_factor`.

    Group-limited routing (DeepSeek-V3): with `num_groups` > 1 the experts form that many equal groups, each
    group scores the sum of its two best selection scores, and a token picks its top-k only among the experts
    of its `topk_groups` best groups.

    One chain of elementwise ops, a top-k and a gather, written so `torch.compile` fuses it into a couple
    of kernels; the [tokens, experts] tensors are small next to the expert matmuls, so no hand kernel.
    """
    match score_function:
        case "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            probs = scores
        case "sigmoid":
            scores = torch.sigmoid(logits.float())
            probs = scores / scores.sum(dim=-1, keepdim=True)
    choice = scores if expert_bias is None else scores + expert_bias
    if num_groups > 1:
        grouped = choice.unflatten(-1, (num_groups, -1))
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, topk_groups or num_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
    if expert_bias is None and num_groups == 1:
        topk_scores, topk_ids = torch.topk(scores, top_k, dim=-1)
    else:
        _, topk_ids = torch.topk(choice, top_k, dim=-1)
        topk_scores = scores.gather(1, topk_ids)
    if renormalize:
        topk_scores = topk_scores / topk_scores.sum(dim=-1, keepdim=True)
    if scaling_factor != 1.0:
        topk_scores = topk_scores * scaling_factor
    return Routing(probs=probs, topk_ids=topk_ids, topk_weights=topk_scores.to(logits.dtype))


class TopKRouter(nn.Module):
    """Scores over experts (softmax, or per-expert sigmoid as in DeepSeek-V3), then the top-k per token.

    - `renormalize`: the k selected probabilities are rescaled to sum to one.
    - `expert_bias` (auxiliary-loss-free balancing, DeepSeek-V3 style): a per-expert bias added to the
      probabilities *for selection only* (weights stay the unbiased probabilities). `update_expert_bias()`
      moves it by `bias_update_rate` towards balance, using the load accumulated since the last update.
    - `num_groups` / `topk_groups`: group-limited routing (DeepSeek-V3: a token's experts come from its
      `topk_groups` best of `num_groups` equal groups); `scaling_factor` multiplies the routing weights
      (DeepSeek-V3's `routed_scaling_factor`).
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
        score_function: ScoreFunction = "softmax",
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
        init_std: float = 0.02,
        num_groups: int = 1,
        topk_groups: int | None = None,
        scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if num_experts % num_groups:
            raise ValueError(f"num_experts={num_experts} does not split into num_groups={num_groups} groups")
        groups_kept = topk_groups or num_groups
        if not 1 <= groups_kept <= num_groups or groups_kept * (num_experts // num_groups) < top_k:
            raise ValueError(
                f"topk_groups={topk_groups} of num_groups={num_groups} groups of {num_experts // num_groups} "
                f"experts cannot hold top_k={top_k}"
            )
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.scaling_factor = scaling_factor
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.score_function: ScoreFunction = score_function
        self.bias_update_rate = bias_update_rate
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.expert_bias: torch.Tensor | None
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.expert_load: torch.Tensor
        # int64: counts stay exact when the model is cast to bfloat16 (which casts floating buffers)
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.reset_parameters()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> TopKRouter:
        # `model.to(bfloat16)` casts floating buffers too; a bf16 bias could not take steps of
        # `bias_update_rate` once it has grown (1e-3 is below half a bf16 ulp above 0.25), so balancing
        # would stall. Device moves apply; the bias stays float32.
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.expert_load.zero_()

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> Routing:
        """`x` [tokens, hidden] → routing decisions. `token_mask` [tokens] (True for real tokens) keeps
        padding out of `expert_load`: the bias moves by the real tokens' loads alone, so how samples are
        grouped into microbatches (which decides the padding) does not change it."""
        routing = route_topk(
            x @ self.weight.t(),
            self.top_k,
            score_function=self.score_function,
            renormalize=self.renormalize,
            expert_bias=self.expert_bias,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            scaling_factor=self.scaling_factor,
        )
        # Training forwards only: an evaluation or inference forward (no grad) between two steps must not
        # move the bias the next optimizer step applies, nor a recompute count its tokens twice.
        if torch.is_grad_enabled() and not is_recomputing():
            with torch.no_grad():
                self.expert_load += tokens_per_expert(routing.topk_ids, self.num_experts, token_mask)
        return routing

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Raises the bias of under-loaded experts and lowers over-loaded ones by `bias_update_rate`, then
        clears the accumulated load. A no-op on the bias (but still clears the load) when disabled."""
        if self.expert_bias is not None:
            load = self.expert_load.double()
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load).to(
                self.expert_bias.dtype
            )
        self.expert_load.zero_()

    @torch.no_grad()
    def reset_expert_load(self) -> None:
        self.expert_load.zero_()
