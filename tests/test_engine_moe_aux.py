"""The balancing loss is summed over tokens when the objective is a token sum (the engine's convention)."""

from __future__ import annotations

import copy

import torch

from d9d.modules.moe import GroupedExperts, MoELayer, TopKRouter, load_balancing_loss


def _layer() -> MoELayer:
    torch.manual_seed(0)
    router = TopKRouter(16, 4, 2)
    experts = GroupedExperts(4, 16, 8)
    experts.reset_parameters()
    return MoELayer(router, experts, aux_loss_coef=0.05)


def test_per_token_aux_gradient_is_token_count_times_the_mean_one() -> None:
    x = torch.randn(3, 5, 16)
    mean_layer = _layer()
    sum_layer = copy.deepcopy(mean_layer)
    sum_layer.aux_loss_per_token = True
    for layer in (mean_layer, sum_layer):
        (layer(x) * 0).sum().backward()  # only the balancing loss sends gradient to the router
    mean_grad = mean_layer.gate.weight.grad
    sum_grad = sum_layer.gate.weight.grad
    assert mean_grad is not None and sum_grad is not None and mean_grad.abs().sum() > 0
    torch.testing.assert_close(sum_grad, 15 * mean_grad)
    # And the mean-style gradient is exactly coef * d(aux)/dW (an independent autograd computation).
    ref = _layer()
    routing = ref.gate(x.reshape(-1, 16))
    (0.05 * load_balancing_loss(routing.probs, routing.topk_ids)).backward()
    torch.testing.assert_close(mean_grad, ref.gate.weight.grad)
