"""Every built-in model family compiled as the engine compiles it (`compile_stage`, aot_eager: the traced
graphs, hooks and custom autograd functions without inductor's slow CPU code generation) against the eager
model: the loss and every parameter's gradient, with each family's training-only pieces on — the MoE
balancing loss weighted and the expert bias for the MoE families, tied embeddings for Llama 3.

A traced autograd Function gives no gradient to an input its forward does not read: that dropped the
balancing loss from compiled MoE blocks without a word (docs/compile.md). This is the net for that class."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from d9d.modules.moe import MoELayer
from d9d.parallel.compile import CompileConfig, compile_stage
from tests.test_parallel_reference import Batch


def _weighted_balancing(model: nn.Module) -> nn.Module:
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert layers, "no MoE layer"
    for layer in layers:
        layer.aux_loss_coef = 0.05
        layer.aux_loss_per_token = True
    return model


def _family(name: str) -> tuple[Callable[[], nn.Module], list[Batch], Callable[[nn.Module, Batch], Any]]:
    match name:
        case "qwen3" | "qwen3_moe":
            from tests.test_parallel_qwen3 import MODELS, _batches, _task_loss

            build = MODELS[name]
            if name == "qwen3_moe":
                return lambda: _weighted_balancing(build()), _batches(1, 4), _task_loss
            return build, _batches(1, 4), _task_loss
        case "llama3":
            from tests import test_models_llama3 as llama

            return lambda: llama._model(tied=True), llama._batches(1, 4), llama._loss
        case "deepseek_v3":
            from tests import test_models_deepseek_v3 as deepseek

            return lambda: _weighted_balancing(deepseek._model()), deepseek._batches(1, 4), deepseek._loss
    raise AssertionError(name)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama3", "deepseek_v3"])
def test_a_compiled_family_has_the_eager_loss_and_gradients(family: str) -> None:
    build, batches, loss_fn = _family(family)
    eager = build()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    report = compile_stage(compiled, CompileConfig(enabled=True, backend="aot_eager"), torch.device("cpu"))
    assert report.modules > 0 and report.stats.failure is None, report
    for model in (eager, compiled):
        model.train()
        loss_fn(model, batches[0]).backward()
    grads = dict(compiled.named_parameters())
    checked = 0
    for name, param in eager.named_parameters():
        want, got = param.grad, grads[name].grad
        assert (want is None) == (got is None), name
        if want is not None and got is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"{family} {name}")
            checked += 1
    assert checked > 0
    if family in ("qwen3_moe", "deepseek_v3"):
        routers = [n for n, p in eager.named_parameters() if n.endswith("gate.weight") and p.grad is not None]
        assert routers, "no router received a gradient"
