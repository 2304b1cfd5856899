"""Which decoder layers each pipeline stage holds.

Every pipeline schedule (and `d9d pipeline-sim`) assumes stages of about equal cost: the slowest stage sets
the pace and the others wait for it. The first stage also embeds the tokens and the last one runs the final
norm, the LM head and the loss, so equal layer counts need not be equal costs.

`split_layers(costs, n)` returns the layers per stage: contiguous, at least one per stage, minimizing the
costliest stage, then the sum of squared stage costs (as even as the integers allow), then preferring the
larger stages last (early stages hold the most in-flight activations under 1F1B-like schedules). With unit
costs for the embedding, each layer and the head it is the even split.

The choice is `model.options.parallel.stage_split` (`StageSplitConfig`):
- `even` (default): the embedding and the head count as one layer each.
- `layers`: the layers per stage, given; `benchmarks/multi_gpu.py` prints each stage's measured work per
  microbatch to choose them from.
- `flops`: the family's cost model (`ModelFamily.stage_costs`: 6 × matmul parameters per token plus the
  attention scores at `seq_len`; embedding lookups are free, the head counts its matmul), the one the MFU
  figure uses (a family without one refuses it). FLOPs are not time: measured on 2 × H200 (Qwen3-0.6B,
  2-sequence microbatches, docs/benchmarks.md, session 28), the head's FLOPs are 7.8 layers' but its time
  2 to 6 layers' (its large matmuls run at a higher rate than a layer's attention and elementwise work,
  and a small microbatch's layers wait for the host), so `flops` put too few layers on the last stage:
  pp 2 under 1F1B 0.73× and ZBV 0.88× the even split. It is for stages whose layers are compute-bound and
  whose head is a small share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


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


class FlopsSplit(BaseModel):
    """Stages of equal FLOPs by the family's cost model, the attention scores at `seq_len` tokens per
    sequence (longer sequences make a layer costlier against the head: give the length you train at)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["flops"] = "flops"
    seq_len: int = Field(4096, ge=1)


class EvenSplit(BaseModel):
    """Equal layer counts, the embedding and the head counted as one layer each (d9d's split before)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["even"] = "even"


class LayersSplit(BaseModel):
    """The decoder layers of each stage, in stage order (pipeline_parallel × stages_per_rank entries)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["layers"] = "layers"
    layers: tuple[Annotated[int, Field(ge=1)], ...] = Field(min_length=1)


StageSplitConfig = Annotated[FlopsSplit | EvenSplit | LayersSplit, Field(discriminator="kind")]


def build_stage_split(
    config: StageSplitConfig,
    num_layers: int,
    num_stages: int,
    stage_costs: Callable[[int], StageCosts] | None,
) -> tuple[int, ...]:
    """Layers per stage for a model of `num_layers` over `num_stages` stages; `stage_costs(seq_len)` is the
    family's cost model (None: it has none, and `flops` is refused). ValueError naming the problem."""
    match config:
        case FlopsSplit(seq_len=seq_len):
            if stage_costs is None:
                raise ValueError(
                    "kind flops needs the model family's cost model (stage_costs); use even or layers"
                )
            costs = stage_costs(seq_len)
            if len(costs.layers) != num_layers:
                raise ValueError(f"the cost model has {len(costs.layers)} layers, the model {num_layers}")
            return split_layers(costs, num_stages)
        case EvenSplit():
            return split_layers(StageCosts.uniform(num_layers), num_stages)
        case LayersSplit(layers=layers):
            check_layer_counts(layers, num_layers, num_stages)
            return layers


def check_layer_counts(counts: Sequence[int], num_layers: int, num_stages: int) -> None:
    if len(counts) != num_stages:
        raise ValueError(f"{len(counts)} stage layer counts {list(counts)} for {num_stages} stages")
    if sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"stage layer counts {list(counts)} must be >= 1 each and sum to the model's {num_layers} layers"
        )
