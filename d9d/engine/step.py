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
from d9d.parallel.grad_sync import GradientSynchronizer, GradSyncConfig, collect_synced_params
from d9d.pipeline.runtime.executor import PipelineExecutor


class StepRunner(Protocol):
    #: The pipeline rank whose ranks compute the loss (and so update task metrics).
    loss_pp_rank: int

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

    loss_pp_rank = 0

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


class PipelinedStepRunner:
    """The local stages run the pipeline program; the loss is computed where the last stage lives."""

    def __init__(
        self,
        executor: PipelineExecutor,
        task: TrainTask,
        device: torch.device,
        metrics: Mapping[str, Any] | None = None,
    ) -> None:
        self.executor = executor
        self.task = task
        self.device = device
        self.metrics = metrics or {}
        self.loss_pp_rank = executor.loss_rank

    def forward_backward(self, microbatches: Sequence[PyTree]) -> tuple[torch.Tensor, torch.Tensor]:
        def loss_fn(outputs: Any, microbatch: int) -> LossOutput:
            loss = self.task.compute_loss(outputs, microbatches[microbatch])
            if self.metrics:
                with torch.no_grad():
                    self.task.update_metrics(self.metrics, outputs, microbatches[microbatch], loss)
            return loss

        inputs = [self.task.forward_inputs(mb) for mb in microbatches]
        result = self.executor.train_step(inputs, loss_fn)
        if result.loss_sum is None or result.weight is None:
            zero = torch.zeros((), dtype=torch.float64, device=self.device)
            return zero, zero.clone()
        return result.loss_sum.detach().double(), result.weight.detach().double()


class SynchronizedGradientReducer:
    """Data-parallel gradients: the synchronizer reduces buckets during backward; `finish` waits and scales.

    The engine already knows the global loss weight (summed over every rank that computes a loss, pipeline
    stages included), so the synchronizer is given that total and only divides by it.
    """

    def __init__(self, synchronizer: GradientSynchronizer) -> None:
        self.synchronizer = synchronizer

    def begin_step(self) -> None:
        return None

    def finish(self, global_weight: torch.Tensor) -> None:
        self.synchronizer.wait(global_weight)


def build_gradient_reducer(
    modules: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    config: GradSyncConfig,
    num_microbatches: int,
) -> GradientReducer:
    """Use the synchronizer when any strategy marked a parameter for reduction, else a local scale."""
    synced = [sp for m, o in zip(modules, optimizers, strict=True) for sp in collect_synced_params(m, o)]
    if any(sp.reduce_mesh is not None for sp in synced):
        return SynchronizedGradientReducer(
            GradientSynchronizer(synced, config, num_microbatches=num_microbatches)
        )
    return LocalGradientReducer(sp.param for sp in synced)


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
