"""RoPE parameters of a Hugging Face `config.json` ⇄ d9d's `RopeScaling`, shared by the families.

Reads both transformers v4 (`rope_theta` + `rope_scaling`) and v5 (`rope_parameters`) spellings; writes v5's.
Anything d9d cannot reproduce exactly is refused with the offending field named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from d9d.modules.rotary import (
    DynamicNTKRopeScaling,
    LinearRopeScaling,
    NoRopeScaling,
    RopeScaling,
    YarnRopeScaling,
)


def rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a config.json in v5's shape (`rope_theta`, `rope_type`, ...)."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"rope_parameters per layer type are not supported: {sorted(params)}")
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported (d9d rotates the whole head)")
    return params


def rope_from_hf(hf: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling]:
    params = rope_parameters(hf)
    theta = float(params["rope_theta"])
    kind = params["rope_type"]
    if kind == "default":
        return theta, NoRopeScaling()
    if kind == "linear":
        return theta, LinearRopeScaling(factor=params["factor"])
    if kind == "dynamic":
        # Hugging Face stretches relative to max_position_embeddings
        return theta, DynamicNTKRopeScaling(
            factor=params["factor"], original_max_position_embeddings=max_positions
        )
    if kind == "yarn":
        original = params.get("original_max_position_embeddings") or max_positions
        factor = params.get("factor") or max_positions / original
        return theta, YarnRopeScaling(
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=params.get("truncate", True),
        )
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, dynamic, yarn)")


def rope_to_hf(theta: float, scaling: RopeScaling, max_positions: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": theta}
    if isinstance(scaling, NoRopeScaling):
        return {**params, "rope_type": "default"}
    if isinstance(scaling, LinearRopeScaling):
        return {**params, "rope_type": "linear", "factor": scaling.factor}
    if isinstance(scaling, DynamicNTKRopeScaling):
        if scaling.original_max_position_embeddings != max_positions:
            raise ValueError(
                "Hugging Face dynamic RoPE scales relative to max_position_embeddings="
                f"{max_positions}, but original_max_position_embeddings="
                f"{scaling.original_max_position_embeddings}"
            )
        return {**params, "rope_type": "dynamic", "factor": scaling.factor}
    return {
        **params,
        "rope_type": "yarn",
        **scaling.model_dump(exclude={"kind"}, exclude_none=True),
    }
