"""What users implement to plug a model, data, a task and an optimizer into the engine.

Each provider kind is a `Protocol` listing every method the engine calls on it. A provider is a class with a
nested pydantic `Config` (its `options` in the job file) and a constructor taking that config; a user's
class named by `module:Class` is checked against its kind's protocol when the config is validated
(`d9d.engine.plugins`). The engine calls providers in a fixed order (see docs/engine.md); they never see
the loop itself, only what they need to do their part.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from d9d.core.context import DistributedContext
from d9d.core.types import PyTree
from d9d.engine.events import EventBus
from d9d.engine.step_metrics import StepMetrics
from d9d.models.family import ModelFamily
from d9d.pipeline.api import PipelineStageInfo


@dataclass(frozen=True)
class DataSetup:
    """What a data provider needs to know to produce this rank's share of each global batch."""

    dp_rank: int
    dp_size: int
    microbatch_size: int
    gradient_accumulation: int
    global_batch_size: int
    seed: int


@runtime_checkable
class ModelProvider(Protocol):
    def build_stage(self, stage: PipelineStageInfo) -> nn.Module:
        """Build the stage's module. Called under `torch.device("meta")`: allocate nothing."""
        ...

    def parallelize(self, module: nn.Module, ctx: DistributedContext) -> None:
        """Apply sharding strategies in place (parameters become DTensors). Still on meta."""
        ...

    def initialize(self, module: nn.Module, ctx: DistributedContext) -> None:
        """Materialized (to_empty) on the device: fill weights — random init or a source checkpoint."""
        ...

    def export(self, modules: Sequence[nn.Module], ctx: DistributedContext, path: Path) -> None:
        """Write the trained model (e.g. in Hugging Face format). Collective over all ranks."""
        ...

    def subscribe(
        self,
        events: EventBus,
        modules: Sequence[nn.Module],
        ctx: DistributedContext,
        metrics: StepMetrics,
    ) -> None:
        """Hook the model's own step logic (e.g. MoE load balancing) to the loop's events; values written to
        `metrics` during a step (or deferred: `StepMetrics.defer`) are logged with it. Training only; a
        model without any does nothing."""
        ...


@runtime_checkable
class ModelFlops(Protocol):
    """Optional trait of a model provider: its training FLOPs per token, which turn tokens/s into MFU
    (the `train/mfu` metric and the console's MFU). A provider without it simply has no MFU."""

    def flops_per_token(self, seq_len: int) -> float:
        """Forward plus backward FLOPs per trained token at sequence length `seq_len` (for a transformer:
        6 × active matmul parameters, plus the attention scores)."""
        ...


@runtime_checkable
class ModelArchitecture(Protocol):
    """Optional trait of a model provider: its model is a registered family's (`d9d.models.family`), with
    this config. The built-in providers have it; a plug-in gets it by being (or wrapping) a family's provider
    (`d9d.engine.builtin.models.family_provider`). With it the dry run estimates memory with the family's
    footprint (tensor-parallel sharding, activations) and preflight checks the mesh against the family's
    splits, as for a built-in model."""

    family: ModelFamily[Any]
    model_config: Any


@runtime_checkable
class DataProvider(Protocol):
    def setup(self, setup: DataSetup) -> None: ...

    def next_step(self) -> list[PyTree]:
        """This rank's `gradient_accumulation` microbatches for the next step."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Position in the global sample stream; must allow resuming under a different dp_size."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass
class LossOutput:
    """A microbatch's summed loss and its weight (e.g. token count). The engine divides the gradient by the
    global sum of weights, so the update is a weighted mean over microbatches and DP ranks."""

    loss_sum: torch.Tensor
    weight: torch.Tensor


@runtime_checkable
class TrainTask(Protocol):
    def forward_inputs(self, microbatch: PyTree) -> dict[str, Any]:
        """Model keyword inputs for a microbatch (every pipeline stage receives them)."""
        ...

    def compute_loss(self, outputs: Any, microbatch: PyTree) -> LossOutput: ...

    def create_metrics(self) -> dict[str, Any]:
        """Metric objects (d9d.metrics) this task updates; synced and logged by the engine."""
        ...

    def update_metrics(
        self, metrics: Mapping[str, Any], outputs: Any, microbatch: PyTree, loss: LossOutput
    ) -> None: ...


@runtime_checkable
class InferenceTask(Protocol):
    def forward_inputs(self, microbatch: PyTree) -> dict[str, Any]: ...

    def process_outputs(self, outputs: Any, microbatch: PyTree) -> None:
        """Consume a microbatch's outputs (accumulate, write)."""
        ...

    def result(self, ctx: DistributedContext) -> dict[str, float]:
        """Final (globally reduced) results."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class OptimizerProvider(Protocol):
    def build(
        self, named_parameters: Iterable[tuple[str, nn.Parameter]], *, seed: int
    ) -> torch.optim.Optimizer:
        """One stage's optimizer. `named_parameters`: every parameter of the stage (optimize those with
        `requires_grad`) in `named_parameters()` order, named as the model's state dict and checkpoints name
        them (module wrappers' `_checkpoint_wrapped_module` / `_orig_mod` segments removed; a pipeline
        stage's names are the whole model's, `model.layers.5...` on the stage holding layer 5).
        `seed`: this stage's parameter seed (shared by replicas), for optimizers with randomness."""
        ...


@runtime_checkable
class OptimizerModelCheck(Protocol):
    """Optional for an optimizer provider: options that must fit the model (parameter name patterns)."""

    def check_model(self, model: ModelProvider, num_stages: int) -> None:
        """Raise a `ValueError` when the options do not fit `model` split into `num_stages` pipeline stages
        (a pattern matching no parameter of any stage). Called on every rank before the stages are built,
        so it must be deterministic (the same on every rank) and use no collective."""
        ...


@runtime_checkable
class LRSchedulerProvider(Protocol):
    def build(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler: ...

    def check_run(self, total_steps: int) -> None:
        """Raise ValueError when the options do not fit a run of `total_steps` (a schedule longer than the
        run); config validation calls it, so the mistake is reported before any process starts."""
        ...
