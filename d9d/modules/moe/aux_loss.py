"""Switch-style load-balancing loss, applied without threading it through the model's outputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

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


class BalancingLoss(NamedTuple):
    share: torch.Tensor  # this rank's part, differentiable in its probabilities
    whole: torch.Tensor  # the loss over every rank's tokens (detached)
    real_tokens: torch.Tensor  # real tokens over every rank (float)


def balancing_loss_over(
    probs: torch.Tensor,
    topk_ids: torch.Tensor,
    token_mask: torch.Tensor | None,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor],
) -> BalancingLoss:
    """`load_balancing_loss` of tokens that several ranks route, each its part of the same sequences
    (tensor-parallel ranks of a token-split MoE layer, context-parallel ranks). `sum_over_ranks` sums a
    tensor over those ranks. The loads, probability sums and token counts are summed first, so the loss is
    the one a single process computes on all the tokens, whatever the split: computed per rank, f·P is
    nonlinear and the objective would change with tp and cp. `share` = `E · Σ_e f_e · (Σ_local p_e) / N`
    with the summed `f` and `N`: the shares add up to the whole loss, and a share's gradient with respect
    to this rank's probabilities is the whole loss's, so the router gradient summed over the ranks (as
    their plans sum it) is that of the single process."""
    num_experts = probs.shape[1]
    real = token_mask.to(probs.dtype) if token_mask is not None else probs.new_ones(probs.shape[0])
    local_probs = (probs * real[:, None]).sum(dim=0)
    with torch.no_grad():
        copies = real[:, None].expand(topk_ids.shape).reshape(-1)
        load = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
        load.scatter_add_(0, topk_ids.reshape(-1), copies)
        summed = sum_over_ranks(torch.cat([load, local_probs.detach(), real.sum()[None]]))
        total_load, total_probs, count = summed.split([num_experts, num_experts, 1])
        count = count.clamp(min=1)
        fraction = total_load / (count * topk_ids.shape[1])
        whole = num_experts * (fraction * total_probs).sum() / count[0]
    share = num_experts * (fraction * local_probs).sum() / count[0]
    return BalancingLoss(share, whole, count[0])


class _AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on `x` whose backward also feeds gradient `coef` into `aux_loss`.

    This adds `coef · aux_loss` to whatever objective `x` ends up in, so the loss needs to travel through
    neither the layer's return value nor the pipeline's stage boundaries.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux_loss: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.coef = coef
        ctx.aux_dtype = aux_loss.dtype
        if torch.compiler.is_compiling():
            # Traced, a Function's input that its forward does not read gets no gradient (torch 2.13's
            # autograd_function_apply under AOTAutograd, aot_eager and inductor alike): the balancing loss's
            # gradient was dropped without a word in compiled MoE blocks. Reading it (adding zero; a NaN
            # loss makes the output NaN, which the router's NaN probabilities do anyway) keeps it.
            return x + 0 * aux_loss.to(x.dtype)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        aux_grad = torch.full((), ctx.coef, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


def attach_auxiliary_loss(x: torch.Tensor, aux_loss: torch.Tensor, coef: float) -> torch.Tensor:
    """Returns `x` unchanged; backpropagating through it also adds `coef · ∂aux_loss` to the gradients."""
    out: torch.Tensor = _AddAuxiliaryLoss.apply(x, aux_loss, coef)
    return out
