"""Switch-style load-balancing loss, applied without threading it through the model's outputs."""

from __future__ import annotations

from typing import Any

import torch

from d9d.modules.moe.counting import tokens_per_expert


def load_balancing_loss(
    probs: torch.Tensor, topk_ids: torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`E · Σ_e f_e · P_e` with `f_e` the fraction of token copies routed to expert e (no gradient) and `P_e`
    the mean router probability of e. Perfect balance gives 1 whatever k is; all tokens on one expert
    with probability 1 gives E. With `token_mask` [tokens] (True for real tokens) both averages run over
    the real tokens only, so padding neither counts as load nor dilutes the probabilities."""
    num_experts = probs.shape[1]
    if token_mask is None:
        with torch.no_grad():
            fraction = tokens_per_expert(topk_ids, num_experts).float() / topk_ids.numel()
        return num_experts * (fraction * probs.mean(dim=0)).sum()
    real = token_mask.to(probs.dtype)
    count = real.sum().clamp(min=1)
    with torch.no_grad():
        copies = real[:, None].expand(topk_ids.shape).reshape(-1)
        load = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
        fraction = load.scatter_add_(0, topk_ids.reshape(-1), copies) / (count * topk_ids.shape[1])
    mean_probs = (probs * real[:, None]).sum(dim=0) / count
    return num_experts * (fraction * mean_probs).sum()


class _AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on `x` whose backward also feeds gradient `coef` into `aux_loss`.

    This adds `coef · aux_loss` to whatever objective `x` ends up in, so the loss needs to travel through
    neither the layer's return value nor the pipeline's stage boundaries.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux_loss: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.coef = coef
        ctx.aux_dtype = aux_loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        aux_grad = torch.full((), ctx.coef, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


def attach_auxiliary_loss(x: torch.Tensor, aux_loss: torch.Tensor, coef: float) -> torch.Tensor:
    """Returns `x` unchanged; backpropagating through it also adds `coef · ∂aux_loss` to the gradients."""
    out: torch.Tensor = _AddAuxiliaryLoss.apply(x, aux_loss, coef)
    return out
