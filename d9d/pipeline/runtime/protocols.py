"""What the executor calls out to: the loss on the last stage and observers of gradient accumulation."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class WeightedLoss(Protocol):
    """A microbatch's summed loss and its weight (e.g. its number of target tokens)."""

    @property
    def loss_sum(self) -> torch.Tensor: ...

    @property
    def weight(self) -> torch.Tensor: ...


class PipelineLossFn(Protocol):
    """Computes the loss of microbatch `microbatch` from the last stage's outputs."""

    def __call__(self, outputs: Any, microbatch: int) -> WeightedLoss: ...


class PipelineOutputFn(Protocol):
    """Consumes the last stage's outputs of microbatch `microbatch` in a forward-only step."""

    def __call__(self, outputs: Any, microbatch: int) -> None: ...


class GradientObserver(Protocol):
    """Told when the gradients of a stage's parameters are complete for a microbatch.

    A gradient synchronizer uses it to know how many microbatches each parameter accumulates in a step (the
    executor's `num_microbatches`) and when a stage's last microbatch is done, e.g. to start reducing.
    """

    def on_step_start(self, num_microbatches: int) -> None: ...

    def on_backward_done(self, stage: int, microbatch: int) -> None:
        """Every weight gradient of `stage` for `microbatch` has been accumulated into `.grad`."""
        ...

    def on_step_end(self) -> None: ...
