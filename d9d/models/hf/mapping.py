"""State mappers between Hugging Face checkpoints and d9d models, for every registered family.

The family's format (`ModelFamily.hf`) builds them; here they are picked by config and checked against a
model's shapes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from pydantic import BaseModel

from d9d.models.family import EXPERT_BIAS_HF_NAME, CheckpointTraits, ExpertLayout
from d9d.models.hf.config import hf_format
from d9d.state.mapper import StateMapper, apply_group

__all__ = [
    "ExpertLayout",
    "d9d_to_hf_mapper",
    "detect_expert_layout",
    "expected_hf_shapes",
    "expert_bias_hf_keys",
    "has_expert_bias",
    "hf_to_d9d_mapper",
]


def detect_expert_layout(keys: Iterable[str]) -> ExpertLayout:
    """`fused` when the checkpoint holds `mlp.experts.gate_up_proj` tensors, `per_expert` otherwise."""
    return CheckpointTraits.of(keys).expert_layout


def has_expert_bias(keys: Iterable[str]) -> bool:
    """Whether a checkpoint's keys carry an expert bias (`e_score_correction_bias`)."""
    return any(k.endswith(EXPERT_BIAS_HF_NAME) for k in keys)


def expert_bias_hf_keys(config: BaseModel) -> list[str]:
    """Checkpoint keys that may be absent for `config` (e.g. d9d's expert bias in a Qwen3-MoE directory)."""
    return hf_format(config).optional_keys(config)


def hf_to_d9d_mapper(
    config: BaseModel,
    *,
    expert_layout: ExpertLayout = "per_expert",
    checkpoint_has_lm_head: bool = True,
    checkpoint_has_expert_bias: bool = False,
) -> StateMapper:
    """HF checkpoint keys → the keys of a whole d9d causal-LM model (narrow it per stage with `Select`).
    The checkpoint's traits come from its key set (`CheckpointTraits.of(keys)`)."""
    traits = CheckpointTraits(expert_layout, checkpoint_has_lm_head, checkpoint_has_expert_bias)
    return hf_format(config).to_d9d(config, traits)


def hf_to_d9d_mapper_for(config: BaseModel, keys: Iterable[str]) -> StateMapper:
    """`hf_to_d9d_mapper` for a checkpoint holding `keys`."""
    return hf_format(config).to_d9d(config, CheckpointTraits.of(keys))


def d9d_to_hf_mapper(config: BaseModel, *, expert_layout: ExpertLayout = "per_expert") -> StateMapper:
    """A whole d9d causal-LM model's keys → HF checkpoint keys."""
    return hf_format(config).to_hf(config, expert_layout)


def expected_hf_shapes(
    config: BaseModel, model_state: Mapping[str, torch.Tensor], expert_layout: ExpertLayout
) -> dict[str, tuple[int, ...]]:
    """The HF key → shape a checkpoint for `config` must have, derived by running the save mapper over
    the (meta-device) state of a whole model, so the expectation can never drift from the mapping."""
    mapper = d9d_to_hf_mapper(config, expert_layout=expert_layout)
    shapes: dict[str, tuple[int, ...]] = {}
    for group in mapper.groups():
        out = apply_group(mapper, group, {k: model_state[k] for k in group.inputs})
        shapes |= {k: tuple(t.shape) for k, t in out.items()}
    return shapes
