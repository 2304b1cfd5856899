"""Model families: everything the engine needs from an architecture, in one spec per family folder.

A family (`d9d/models/<family>/`) owns its config class, modules, Hugging Face format, parallelization
plan and cost model, and registers a `ModelFamily` when its package is imported. The engine never names a
family: its `model` section, preflight, dry run, parallel checks and config reference iterate over
`families()`, and a config finds its family with `family_of(config)`. Built-in families are listed once, in
`d9d.models.catalogue`; a user family calls `register_family` and is used through a plug-in provider
(docs/models.md).

The spec holds plain functions, not a class hierarchy to inherit from (torchtitan's per-family train spec is
the model: a family says how, the engine decides when).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import torch
from pydantic import BaseModel
from torch import nn

from d9d.core.context import DistributedContext
from d9d.parallel.plans.config import ParallelPlanConfig
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.partition import StageCosts
from d9d.state.mapper import StateMapper

ExpertLayout = Literal["per_expert", "fused"]
"""How a Hugging Face checkpoint stores MoE experts: one module per expert (`mlp.experts.{e}.*`, what
transformers writes) or fused `[E, ...]` tensors (transformers v5's in-memory layout)."""

# d9d's aux-loss-free expert bias in Hugging Face files (DeepSeek-V3's name for the same tensor).
EXPERT_BIAS_HF_NAME = "mlp.gate.e_score_correction_bias"


class FamilyConfig(Protocol):
    """What the engine reads from any family's config (its own fields are the family's business)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def tie_word_embeddings(self) -> bool: ...


C = TypeVar("C", bound=BaseModel)


@dataclass(frozen=True)
class CheckpointTraits:
    """What a Hugging Face checkpoint's key set says about how it maps onto a model."""

    expert_layout: ExpertLayout = "per_expert"
    has_lm_head: bool = True
    has_expert_bias: bool = False

    @classmethod
    def of(cls, keys: Iterable[str]) -> CheckpointTraits:
        keys = set(keys)
        return cls(
            expert_layout="fused"
            if any(k.endswith("mlp.experts.gate_up_proj") for k in keys)
            else "per_expert",
            has_lm_head="lm_head.weight" in keys,
            has_expert_bias=any(k.endswith(EXPERT_BIAS_HF_NAME) for k in keys),
        )


def _exact(_config: Any) -> str | None:
    return None


def _no_keys(_config: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class HuggingFaceFormat(Generic[C]):
    """A family's Hugging Face interop: `config.json` both ways and the state mappers both ways.

    - `model_types`: the `config.json` `model_type`s this family reads (the first is the one it writes).
    - `config_from_hf(hf, overrides)`: the d9d config; `overrides` set d9d-only fields or replace converted
      ones. Refuse what the family cannot reproduce exactly, naming the field.
    - `to_d9d(config, traits)`: checkpoint keys → the keys of a whole causal-LM model (`build_causal_lm`
      with no stage); `to_hf(config, layout)`: the inverse, for export.
    - `export_gap(config)`: why transformers would compute other logits from an export (a part of the model
      its format cannot hold), None when exact.
    - `optional_keys(config)`: checkpoint keys that may be absent (and are dropped when the config does not
      want them), e.g. a d9d-only expert bias.
    """

    model_types: tuple[str, ...]
    config_from_hf: Callable[[Mapping[str, Any], Mapping[str, Any]], C]
    config_to_hf: Callable[[C], dict[str, Any]]
    to_d9d: Callable[[C, CheckpointTraits], StateMapper]
    to_hf: Callable[[C, ExpertLayout], StateMapper]
    export_gap: Callable[[C], str | None] = _exact
    optional_keys: Callable[[C], list[str]] = _no_keys


@dataclass(frozen=True)
class MeshSplit:
    """A size a parallel dimension splits: `mesh.<dim>` must divide `<field>` of the architecture."""

    field: str
    size: int
    dim: Literal["tensor_parallel", "expert_parallel"]


@dataclass(frozen=True)
class StageFootprint:
    """What the dry run's memory estimate needs from one (meta-device) stage of the family's model.

    - `tensor_parallel`: the parameters the family's plan splits over `tensor_parallel` (expert weights
      are always split over `expert_parallel` instead and need not be listed).
    - `layer_values`: per decoder layer (global index), the values it keeps for backward per token
      (stored in the parameter dtype, split over tp × cp).
    - `loss_chunk`: `(tokens, vocab)` of the float32 logits chunk the last stage's loss holds, or None.
    - `layer_input_values`: values per token of a layer's input (`hidden_size`): all that a checkpointed
      layer keeps (0: not modelled, activation checkpointing is then not estimated).
    - `layer_op_values`: per layer, the values per token of the outputs op-level selective checkpointing
      keeps (matmuls and attention), None when not modelled.
    """

    tensor_parallel: frozenset[nn.Parameter]
    layer_values: Mapping[int, int]
    loss_chunk: tuple[int, int] | None = None
    layer_input_values: int = 0
    layer_op_values: Mapping[int, int] | None = None

    @property
    def activation_values_per_token(self) -> int:
        """Values kept for backward per token, summed over the stage's layers (without checkpointing)."""
        return sum(self.layer_values.values())


ParallelizeFn = Callable[[nn.Module, DistributedContext, ParallelPlanConfig, "torch.dtype | None"], None]


@dataclass(frozen=True)
class ModelFamily(Generic[C]):
    """One architecture, as the engine uses it.

    - `name`: the built-in provider name in job files (`model.provider: <name>`).
    - `config_class`: its pydantic config (`model.options.architecture` is validated against it).
    - `build_causal_lm(config, stage)`: the causal-LM module for one pipeline stage (None: the whole
      model); the engine calls it under `torch.device("meta")`.
    - `parallelize(module, ctx, plan, activation_dtype)`: apply expert / tensor / context / data
      parallelism to a stage in place, as `ctx`'s mesh asks.
    - `flops_per_token(config, seq_len)`: training FLOPs per token (MFU).
    - `stage_costs(config, seq_len)`: the same per embedding, layer and head, for pipeline stages of equal
      cost (`model.options.parallel.stage_split: flops`; None: that choice is refused).
    - `footprint(config, stage_module)`: the dry run's view of a stage (None: not modelled).
    - `mesh_splits(config)`: the sizes tensor / expert parallelism split (preflight checks divisibility).
    - `context_parallel`: whether `parallelize` installs context-parallel attention.
    - `activation_checkpointing`: whether its stages hold a decoder stack the job's `activation_checkpointing`
      section applies to (`d9d.modules.checkpointing.CheckpointableStack`, e.g. `DecoderBackbone`); a family
      without one is refused at config validation when the section asks for checkpointing.
    - `hf`: the Hugging Face format, or None when the family has none.
    """

    name: str
    config_class: type[C]
    build_causal_lm: Callable[[C, PipelineStageInfo | None], nn.Module]
    parallelize: ParallelizeFn
    flops_per_token: Callable[[C, int], float]
    footprint: Callable[[C, nn.Module], StageFootprint | None]
    mesh_splits: Callable[[C], list[MeshSplit]]
    hf: HuggingFaceFormat[C] | None = None
    stage_costs: Callable[[C, int], StageCosts] | None = None
    context_parallel: bool = True
    activation_checkpointing: bool = True
    description: str = ""


_REGISTRY: dict[str, ModelFamily[Any]] = {}


def register_family(family: ModelFamily[Any]) -> ModelFamily[Any]:
    """Add a family (idempotent for the same spec); names and Hugging Face model types must be unique."""
    known = _REGISTRY.get(family.name)
    if known is family:
        return family
    if known is not None:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    if family.hf is not None:
        for other in _REGISTRY.values():
            shared = set(family.hf.model_types) & set(other.hf.model_types if other.hf else ())
            if shared:
                raise ValueError(
                    f"family {family.name!r} reads model_type {sorted(shared)}, which {other.name!r} reads"
                )
    _REGISTRY[family.name] = family
    return family


def families() -> list[ModelFamily[Any]]:
    """Every registered family: the built-ins in catalogue order, then the others in registration order."""
    from d9d.models.catalogue import BUILTIN_FAMILIES  # the family packages import this module

    builtin = [_REGISTRY[name] for name in BUILTIN_FAMILIES]
    return builtin + [f for f in _REGISTRY.values() if f.name not in BUILTIN_FAMILIES]


def get_family(name: str) -> ModelFamily[Any]:
    known = {f.name: f for f in families()}
    if name not in known:
        raise KeyError(f"no model family {name!r} (registered: {', '.join(known)})")
    return known[name]


def family_of(config: BaseModel) -> ModelFamily[Any]:
    """The family whose config class is the closest base of `config`'s class."""
    registered = families()
    for cls in type(config).__mro__:
        for family in registered:
            if family.config_class is cls:
                return family
    raise TypeError(f"{type(config).__name__} is not the config of a registered model family")


def check_checkpointing_family(family: ModelFamily[Any], field: str, mode: str) -> None:
    """Raises ValueError naming the family when its stages have no decoder stack for the job's
    `activation_checkpointing` (mode `mode`, the model chosen at `field`)."""
    if not family.activation_checkpointing:
        capable = ", ".join(f"'{f.name}'" for f in families() if f.activation_checkpointing)
        raise ValueError(
            f"activation_checkpointing.mode={mode}: {field} is the {family.name!r} family, whose stages have "
            f"no decoder stack to checkpoint (families that do: {capable}); set mode: none"
        )


def family_for_model_type(model_type: object) -> ModelFamily[Any]:
    """The family that reads a Hugging Face `config.json` of this `model_type`."""
    readable = {t: f for f in families() if f.hf is not None for t in f.hf.model_types}
    if model_type not in readable:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(readable)})")
    return readable[model_type]  # type: ignore[index]
