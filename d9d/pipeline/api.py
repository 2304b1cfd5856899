"""The contract between models and the pipeline engine.

A pipelining-aware model is built *for a stage*: it holds only its layer range (embeddings on the first
stage, final norm + head on the last) and declares the tensors it sends to the next stage, so the
executor can preallocate receive buffers before any microbatch runs. This module imports nothing but
torch and the standard-library partition beside it (`d9d.pipeline.partition`) so that model code can
depend on it without pulling in the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from d9d.pipeline.partition import StageCosts, check_layer_counts, split_layers


@dataclass(frozen=True)
class PipelineStageInfo:
    """Which stage a model instance is. `num_stages` counts virtual stages (pp × stages per rank).
    `layer_counts`: the decoder layers of every stage, in stage order, when the model's provider chose them
    (`d9d.pipeline.split`); None: `balance_layers`' even split. Not part of equality: two infos are equal
    when they name the same place in the pipeline (the executor places stages by index)."""

    current_stage: int = 0
    num_stages: int = 1
    layer_counts: tuple[int, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if not 0 <= self.current_stage < self.num_stages:
            raise ValueError(f"current_stage {self.current_stage} is outside [0, {self.num_stages})")
        if self.layer_counts is not None and (
            len(self.layer_counts) != self.num_stages or min(self.layer_counts) < 1
        ):
            raise ValueError(
                f"layer_counts {list(self.layer_counts)}: one count >= 1 per stage of {self.num_stages}"
            )

    @property
    def is_first(self) -> bool:
        return self.current_stage == 0

    @property
    def is_last(self) -> bool:
        return self.current_stage == self.num_stages - 1


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor crossing a stage boundary, for one microbatch."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@runtime_checkable
class PipelineStageModel(Protocol):
    """A model built for one pipeline stage.

    `forward(**inputs)` takes the microbatch's model inputs (every stage receives them, e.g. position ids
    and masks) plus, for non-first stages, the tensors received from the previous stage (by name). A
    non-last stage returns the dict of tensors to send; the last stage returns its outputs (logits or
    per-token loss).
    """

    stage: PipelineStageInfo

    def stage_output_meta(self, microbatch_inputs: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
        """What this stage sends downstream for a microbatch with these inputs (empty on the last stage)."""
        ...


def balance_layers(
    num_layers: int,
    stage: PipelineStageInfo,
    *,
    virtual_layers_pre: int = 1,
    virtual_layers_post: int = 1,
) -> range:
    """The transformer layers stage `stage` holds: `stage.layer_counts` when given, else an even split.

    The even split counts embeddings (first stage) and final norm + head (last stage) as
    `virtual_layers_pre` / `virtual_layers_post` layers (`d9d.pipeline.partition.split_layers` with those
    costs). Stages that get one more than the others are the last ones, because early stages hold the most
    in-flight activations under 1F1B-like schedules. (A model's provider chooses the counts from
    `model.options.parallel.stage_split`: `d9d.pipeline.split`.)
    """
    counts = stage.layer_counts
    if counts is None:
        uniform = StageCosts(float(virtual_layers_pre), (1.0,) * num_layers, float(virtual_layers_post))
        counts = split_layers(uniform, stage.num_stages)
    else:
        check_layer_counts(counts, num_layers, stage.num_stages)
    begin = sum(counts[: stage.current_stage])
    return range(begin, begin + counts[stage.current_stage])


def needed_input_grads(ctx: torch.autograd.function.FunctionCtx) -> tuple[bool, ...]:
    """Which input gradients a custom autograd function's backward must compute in *this* backward call.

    `ctx.needs_input_grad` is fixed at forward time, so under split backward (input gradients in one pass,
    weight gradients in a later one) a function that trusts it computes its weight gradient in both passes.
    This asks the autograd engine whether the node consuming each gradient will run; functions with costly
    gradients (grouped matmul) should skip the others and return None for them.
    """
    needed = []
    # At backward time ctx is the function's backward node, whose edges lead to the inputs' consumers.
    edges = ctx.next_functions  # type: ignore[attr-defined]
    for (node, _), static in zip(edges, ctx.needs_input_grad, strict=True):  # type: ignore[attr-defined]
        if node is None or not static:
            needed.append(False)
            continue
        try:
            needed.append(bool(torch._C._will_engine_execute_node(node)))
        except RuntimeError:  # a leaf requested by torch.autograd.grad: the engine cannot say, so compute it
            needed.append(True)
    return tuple(needed)
