"""Causal-LM pretraining and perplexity tasks for the catalogue's causal-LM models.

The models return a per-token loss (0 where the label is -100) when given labels, so neither task ever
materializes full-vocabulary logits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from d9d.core.context import DistributedContext
from d9d.core.types import PyTree
from d9d.engine.providers import LossOutput

IGNORE_INDEX = -100
# `padding_side` is the collator's declaration (a string, not a tensor) that lets the model drop a
# right-padding key mask and keep the plain causal kernel without inspecting the mask on the device
_MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask", "segment_ids", "labels", "padding_side")


def _model_inputs(microbatch: PyTree) -> dict[str, Any]:
    return {k: microbatch[k] for k in _MODEL_INPUTS if k in microbatch}


def _loss(outputs: Any, microbatch: PyTree) -> LossOutput:
    per_token: torch.Tensor = outputs["loss"]
    weight = (microbatch["labels"] != IGNORE_INDEX).sum()
    return LossOutput(per_token.sum(), weight.to(per_token.dtype))


class _NoOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CausalLMTask:
    """Next-token prediction; the loss weight is the number of target tokens, so the step's loss is the
    mean over every target token of the global batch whatever the microbatching."""

    class Config(_NoOptions):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def forward_inputs(self, microbatch: PyTree) -> dict[str, Any]:
        return _model_inputs(microbatch)

    def compute_loss(self, outputs: Any, microbatch: PyTree) -> LossOutput:
        return _loss(outputs, microbatch)

    def create_metrics(self) -> dict[str, Any]:
        return {}

    def update_metrics(
        self, metrics: Mapping[str, Any], outputs: Any, microbatch: PyTree, loss: LossOutput
    ) -> None:
        return None


class PerplexityTask:
    """exp(mean token negative log-likelihood) over the whole evaluated text, across all DP ranks."""

    class Config(_NoOptions):
        pass

    def __init__(self, config: Config) -> None:
        self.nll_sum = 0.0
        self.tokens = 0.0

    def forward_inputs(self, microbatch: PyTree) -> dict[str, Any]:
        return _model_inputs(microbatch)

    def process_outputs(self, outputs: Any, microbatch: PyTree) -> None:
        loss = _loss(outputs, microbatch)
        self.nll_sum += float(loss.loss_sum.double())
        self.tokens += float(loss.weight)

    def result(self, ctx: DistributedContext) -> dict[str, float]:
        totals = torch.tensor([self.nll_sum, self.tokens], dtype=torch.float64)
        if ctx.is_distributed:
            dist.all_reduce(totals)
        nll, tokens = float(totals[0]), float(totals[1])
        return {"perplexity": math.exp(nll / tokens), "nll": nll / tokens, "tokens": tokens}

    def state_dict(self) -> dict[str, Any]:
        return {"nll_sum": self.nll_sum, "tokens": self.tokens}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.nll_sum = float(state["nll_sum"])
        self.tokens = float(state["tokens"])
