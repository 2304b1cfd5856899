"""Scalar aggregations: sum, (weighted) mean, max, min of everything a metric was fed.

Sums accumulate in float64 so that a loss summed over millions of tokens and many ranks keeps its
digits; the cost is a few bytes of state.
"""

from __future__ import annotations

import torch

from d9d.metrics.base import Metric

_ACC_DTYPE = torch.float64


def _as_values(value: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=_ACC_DTYPE)
    return torch.as_tensor(value, dtype=_ACC_DTYPE, device=device)


class SumMetric(Metric[torch.Tensor]):
    """Sum of every element passed to `update`."""

    def __init__(self) -> None:
        super().__init__()
        self.total = self.add_state("total", torch.zeros((), dtype=_ACC_DTYPE), "sum")

    def update(self, value: torch.Tensor | float) -> None:
        self.total.value += _as_values(value, self.device).sum()

    def compute(self) -> torch.Tensor:
        return self.total.value.clone()


class WeightedMeanMetric(Metric[torch.Tensor]):
    """sum(value * weight) / sum(weight) over every update; NaN while the total weight is 0.

    The weight is what makes means over ranks and steps exact: a per-batch loss averaged over its token
    count is fed with `weight=num_tokens`, so batches (and ranks) with more tokens count for more.
    """

    def __init__(self) -> None:
        super().__init__()
        self.weighted_sum = self.add_state("weighted_sum", torch.zeros((), dtype=_ACC_DTYPE), "sum")
        self.weight = self.add_state("weight", torch.zeros((), dtype=_ACC_DTYPE), "sum")

    def update(self, value: torch.Tensor | float, weight: torch.Tensor | float = 1.0) -> None:
        values = _as_values(value, self.device)
        weights = _as_values(weight, self.device)
        try:
            values, weights = torch.broadcast_tensors(values, weights)
        except RuntimeError as err:
            raise ValueError(
                f"{type(self).__name__}.update: weight shape {tuple(weights.shape)} does not broadcast to "
                f"value shape {tuple(values.shape)}"
            ) from err
        self.weighted_sum.value += (values * weights).sum()
        self.weight.value += weights.sum()

    def compute(self) -> torch.Tensor:
        return self.weighted_sum.value / self.weight.value


class MeanMetric(WeightedMeanMetric):
    """Arithmetic mean of every element passed to `update`: a weighted mean whose weights default to 1."""


class MaxMetric(Metric[torch.Tensor]):
    """Largest element seen; -inf before the first update."""

    def __init__(self) -> None:
        super().__init__()
        self.best = self.add_state("best", torch.full((), -torch.inf, dtype=_ACC_DTYPE), "max")

    def update(self, value: torch.Tensor | float) -> None:
        values = _as_values(value, self.device)
        if values.numel():
            self.best.value = torch.maximum(self.best.value, values.max())

    def compute(self) -> torch.Tensor:
        return self.best.value.clone()


class MinMetric(Metric[torch.Tensor]):
    """Smallest element seen; +inf before the first update."""

    def __init__(self) -> None:
        super().__init__()
        self.best = self.add_state("best", torch.full((), torch.inf, dtype=_ACC_DTYPE), "min")

    def update(self, value: torch.Tensor | float) -> None:
        values = _as_values(value, self.device)
        if values.numel():
            self.best.value = torch.minimum(self.best.value, values.min())

    def compute(self) -> torch.Tensor:
        return self.best.value.clone()
