"""One stage on this rank: its module plus the state each in-flight microbatch keeps between passes.

The state of a (stage, microbatch) lives from its forward until its last backward pass: the received inputs
(leaf tensors whose gradients go upstream), the tensors to backpropagate from, and, between an input backward
and its weight backward, the deferred weight pass. Everything else about a step (the loss totals, tensors in
flight between stages) is the executor's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from d9d.pipeline.api import PipelineStageInfo, PipelineStageModel, TensorMeta
from d9d.pipeline.autograd import DeferredWeightGrad, backward_input
from d9d.pipeline.runtime.protocols import PipelineLossFn, PipelineOutputFn


def is_differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


@dataclass
class _MicrobatchState:
    inputs: dict[str, torch.Tensor]
    roots: list[torch.Tensor] = field(default_factory=list)
    """Tensors the backward starts from: the scaled loss, or the outputs sent downstream."""
    root_names: list[str] = field(default_factory=list)
    deferred: DeferredWeightGrad | None = None


class StageRuntime:
    def __init__(self, module: nn.Module, info: PipelineStageInfo) -> None:
        if not isinstance(module, PipelineStageModel):
            raise TypeError(
                f"stage {info.current_stage}: {type(module).__name__} does not implement PipelineStageModel "
                "(a `stage` attribute and `stage_output_meta`)"
            )
        if module.stage != info:
            raise ValueError(f"module was built for {module.stage}, but is placed as {info}")
        self.module: nn.Module = module
        self._contract: PipelineStageModel = module
        self.info = info
        self._states: dict[int, _MicrobatchState] = {}

    @property
    def index(self) -> int:
        return self.info.current_stage

    def output_meta(self, microbatch_inputs: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
        if self.info.is_last:
            return {}
        meta = self._contract.stage_output_meta(microbatch_inputs)
        return dict(sorted(meta.items()))

    def forward(
        self,
        microbatch: int,
        model_inputs: Mapping[str, torch.Tensor],
        received: Mapping[str, torch.Tensor],
        *,
        loss_fn: PipelineLossFn | None,
        output_fn: PipelineOutputFn | None,
        loss_scale: float,
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """Run the microbatch; returns (tensors for the next stage, loss result on the last stage)."""
        training = loss_fn is not None
        inputs = {
            name: t.requires_grad_(training and is_differentiable(t.dtype)) for name, t in received.items()
        }
        clash = sorted(set(inputs) & set(model_inputs))
        if clash:
            raise ValueError(
                f"stage {self.index}: received tensors {clash} clash with model inputs of that name"
            )
        with torch.set_grad_enabled(training):
            outputs = self.module(**model_inputs, **inputs)
        if self.info.is_last:
            if loss_fn is None:
                assert output_fn is not None
                output_fn(outputs, microbatch)
                return {}, None
            loss = loss_fn(outputs, microbatch)
            self._states[microbatch] = _MicrobatchState(inputs, [loss.loss_sum * loss_scale], ["loss"])
            return {}, loss
        sent = self._check_outputs(outputs, model_inputs)
        if training:
            names = [n for n, t in sent.items() if t.requires_grad]
            self._states[microbatch] = _MicrobatchState(inputs, [sent[n] for n in names], names)
        return {name: t.detach() for name, t in sent.items()}, None

    def backward(
        self, microbatch: int, output_grads: Mapping[str, torch.Tensor] | None, *, split: bool
    ) -> dict[str, torch.Tensor]:
        """Full backward, or (`split`) its input part with the weight part kept for `backward_weight`.

        Returns the gradients of the received floating-point inputs (zeros where an input was unused).
        """
        state = self._states[microbatch]
        grads = [None if output_grads is None else output_grads[n] for n in state.root_names]
        if self.info.is_last:
            grads = [torch.ones_like(state.roots[0])]
        names = list(state.inputs)
        tensors = list(state.inputs.values())
        if split:
            input_grads, state.deferred = backward_input(state.roots, grads, tensors, self._params())
        else:
            pairs = [(r, g) for r, g in zip(state.roots, grads, strict=True) if g is not None]
            if pairs:
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
            input_grads = [t.grad if t.requires_grad else None for t in tensors]
            del self._states[microbatch]
        state.roots = []
        return {
            name: torch.zeros_like(t) if g is None else g
            for name, t, g in zip(names, tensors, input_grads, strict=True)
            if is_differentiable(t.dtype)
        }

    def backward_weight(self, microbatch: int) -> None:
        state = self._states.pop(microbatch)
        if state.deferred is None:
            raise RuntimeError(
                f"stage {self.index} microbatch {microbatch}: weight pass before its input pass"
            )
        state.deferred.run()

    def check_drained(self) -> None:
        if self._states:
            raise RuntimeError(
                f"stage {self.index} still holds microbatches {sorted(self._states)} after the step"
            )

    def _params(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _check_outputs(
        self, outputs: Any, model_inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        if not isinstance(outputs, Mapping) or not all(isinstance(t, torch.Tensor) for t in outputs.values()):
            raise TypeError(f"stage {self.index} is not the last stage and must return a dict of tensors")
        expected = self.output_meta(model_inputs)
        got = {n: TensorMeta(tuple(t.shape), t.dtype) for n, t in sorted(outputs.items())}
        if got != expected:
            raise ValueError(
                f"stage {self.index} returned {_describe(got)} but stage_output_meta declared "
                f"{_describe(expected)}"
            )
        return dict(sorted(outputs.items()))


def _describe(metas: Mapping[str, TensorMeta]) -> str:
    return "{" + ", ".join(f"{n}: {tuple(m.shape)} {m.dtype}" for n, m in metas.items()) + "}"
