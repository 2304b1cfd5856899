"""Forward/backward over a step's microbatches, and the seams where parallelism plugs in.

`StepRunner` runs every microbatch of a step through the local stage(s) and returns the local loss sum and
weight; the sequential runner does it for one stage, the pipeline runner (d9d.pipeline) for many.
`GradientReducer` finishes gradients after the last backward: DP reduction (d9d.parallel's synchronizer)
and the division by the global loss weight. Keeping these as protocols lets the loop stay the same for a
single process, DP, FSDP, EP and PP.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from d9d.core.types import PyTree
from d9d.engine.providers import LossOutput, TrainTask


class StepRunner(Protocol):
    def forward_backward(self, microbatches: Sequence[PyTree]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run all microbatches; return local (loss sum, loss weight), zeros where no loss is computed."""
        ...


class GradientReducer(Protocol):
    def begin_step(self) -> None: ...

    def finish(self, global_weight: torch.Tensor) -> None:
        """After the last backward: finish any reduction and divide gradients by `global_weight`."""
        ...


class SequentialStepRunner:
    """One stage holds the whole model: plain forward/backward per microbatch, gradients accumulate."""

    def __init__(
        self,
        module: nn.Module,
        task: TrainTask,
        device: torch.device,
        metrics: Mapping[str, Any] | None = None,
    ) -> None:
        self.module = module
        self.task = task
        self.device = device
        self.metrics = metrics or {}

    def forward_backward(self, microbatches: Sequence[PyTree]) -> tuple[torch.Tensor, torch.Tensor]:
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        weight_total = torch.zeros((), dtype=torch.float64, device=self.device)
        for microbatch in microbatches:
            outputs = self.module(**self.task.forward_inputs(microbatch))
            loss: LossOutput = self.task.compute_loss(outputs, microbatch)
            loss.loss_sum.backward()
            with torch.no_grad():
                loss_total += loss.loss_sum.detach().double()
                weight_total += loss.weight.detach().double()
                if self.metrics:
                    self.task.update_metrics(self.metrics, outputs, microbatch, loss)
        return loss_total, weight_total


class LocalGradientReducer:
    """No data parallelism: gradients are complete after backward and only need the weight division."""

    def __init__(self, parameters: Iterable[nn.Parameter]) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]

    def begin_step(self) -> None:
        return None

    def finish(self, global_weight: torch.Tensor) -> None:
        scale = 1.0 / float(global_weight)
        with torch.no_grad():
            for p in self.parameters:
                if p.grad is not None:
                    p.grad.mul_(scale)
