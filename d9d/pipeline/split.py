"""Which decoder layers each pipeline stage holds.

Every pipeline schedule (and `d9d pipeline-sim`) assumes stages of about equal cost: the slowest stage sets
the pace and the others wait for it. The first stage also embeds the tokens and the last one runs the final
norm, the LM head and the loss, so equal layer counts need not be equal costs.

The split itself is `d9d.pipeline.partition.split_layers` over the pieces' costs.

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

from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from d9d.pipeline.partition import StageCosts, check_layer_counts, split_layers


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
