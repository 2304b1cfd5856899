"""Splitting a model's decoder layers into pipeline stages of equal cost (standard library only, so the
model contract `d9d.pipeline.api` uses it too).

`split_layers(costs, n)` returns the layers per stage: contiguous, at least one per stage, minimizing the
costliest stage, then the sum of squared stage costs (as even as the integers allow), then preferring the
larger stages last (early stages hold the most in-flight activations under 1F1B-like schedules). With unit
costs for the embedding, each layer and the head it is the even split (`balance_layers`' default). The
choice of costs is `d9d.pipeline.split`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageCosts:
    """Per-token cost of a model's pieces, in any one unit (FLOPs): the first stage's own work (embedding),
    each decoder layer's, and the last stage's own work (final norm, head, loss)."""

    first: float
    layers: tuple[float, ...]
    last: float

    @property
    def total(self) -> float:
        return self.first + sum(self.layers) + self.last

    @classmethod
    def uniform(cls, num_layers: int) -> StageCosts:
        """The embedding and the head as one layer each: the `even` split."""
        return cls(1.0, (1.0,) * num_layers, 1.0)


def split_layers(costs: StageCosts, num_stages: int) -> tuple[int, ...]:
    """Layers per stage (module docstring); ValueError when there are fewer layers than stages."""
    return _split(costs.first, costs.layers, costs.last, num_stages)


@functools.cache
def _split(first: float, layers: tuple[float, ...], last: float, n: int) -> tuple[int, ...]:
    num = len(layers)
    if n < 1:
        raise ValueError(f"num_stages must be >= 1, got {n}")
    if num < n:
        raise ValueError(f"{num} layers cannot be split over {n} stages of at least one layer each")
    prefix = [0.0]
    for c in layers:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, start: int, end: int) -> float:
        """Stage `stage` holding layers [start, end)."""
        return (
            prefix[end] - prefix[start] + (first if stage == 0 else 0.0) + (last if stage == n - 1 else 0.0)
        )

    def choices(stage: int, end: int) -> range:
        """Where stage `stage` may start when it ends at layer `end`: each earlier stage keeps one layer."""
        return range(stage, end)

    # 1. the smallest possible costliest stage
    inf = float("inf")
    worst = [[inf] * (num + 1) for _ in range(n)]  # worst[s][e]: stages 0..s over layers [0, e)
    for e in range(1, num + 1):
        worst[0][e] = cost(0, 0, e)
    for s in range(1, n):
        for e in range(s + 1, num + 1):
            worst[s][e] = min(max(worst[s - 1][b], cost(s, b, e)) for b in choices(s, e))
    bound = worst[n - 1][num] * (1 + 1e-12)
    # 2. under that bound: the least sum of squares, then the most cost on later stages (Σ s · cost)
    best: list[list[tuple[float, float] | None]] = [[None] * (num + 1) for _ in range(n)]
    start: list[list[int]] = [[0] * (num + 1) for _ in range(n)]
    for e in range(1, num + 1):
        c = cost(0, 0, e)
        if c <= bound:
            best[0][e] = (c * c, 0.0)
    for s in range(1, n):
        for e in range(s + 1, num + 1):
            for b in choices(s, e):
                before = best[s - 1][b]
                c = cost(s, b, e)
                if before is None or c > bound:
                    continue
                key = (before[0] + c * c, before[1] - s * c)
                current = best[s][e]
                if current is None or key < current:
                    best[s][e], start[s][e] = key, b
    counts, end = [], num
    for s in range(n - 1, 0, -1):
        b = start[s][end]
        counts.append(end - b)
        end = b
    counts.append(end)
    return tuple(reversed(counts))


def check_layer_counts(counts: Sequence[int], num_layers: int, num_stages: int) -> None:
    if len(counts) != num_stages:
        raise ValueError(f"{len(counts)} stage layer counts {list(counts)} for {num_stages} stages")
    if sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"stage layer counts {list(counts)} must be >= 1 each and sum to the model's {num_layers} layers"
        )
