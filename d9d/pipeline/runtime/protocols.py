"""What the executor calls out to: the loss (or output consumer) on the last stage."""

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
