"""Hugging Face `config.json` ⇄ d9d model configs, for every registered family (`ModelFamily.hf`).

A config.json's `model_type` picks the family that reads it; a d9d config's class picks the family that
writes it. The families refuse what they cannot reproduce exactly, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from d9d.models.family import EXPERT_BIAS_HF_NAME, HuggingFaceFormat, family_for_model_type, family_of

# config.json flag that turns on the d9d-only expert bias of Qwen3-MoE on reload (transformers ignores it)
EXPERT_BIAS_CONFIG_KEY = "d9d_expert_bias"

__all__ = [
    "EXPERT_BIAS_CONFIG_KEY",
    "EXPERT_BIAS_HF_NAME",
    "config_from_hf",
    "config_to_hf",
    "hf_export_gap",
    "hf_format",
]


def hf_format(config: BaseModel) -> HuggingFaceFormat[Any]:
    """The Hugging Face format of `config`'s family (ValueError when it has none)."""
    family = family_of(config)
    if family.hf is None:
        raise ValueError(f"model family {family.name!r} has no Hugging Face format")
    return family.hf


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> Any:
    """The d9d config of a parsed `config.json`, by its `model_type`; `overrides` set d9d-only fields (e.g.
    `attention_backend`, `vocab_splits`, `expert_bias`) or replace converted ones."""
    family = family_for_model_type(hf.get("model_type"))
    assert family.hf is not None
    return family.hf.config_from_hf(hf, overrides)


def config_to_hf(config: BaseModel) -> dict[str, Any]:
    """The `config.json` content transformers needs to rebuild `config`."""
    return hf_format(config).config_to_hf(config)


def hf_export_gap(config: BaseModel) -> str | None:
    """Why transformers would compute different logits from a Hugging Face export of `config` (a part of
    the model its format cannot hold), or None when the export is exact."""
    return hf_format(config).export_gap(config)
