"""RoPE frequency-scaling schemes, as a discriminated union of configs."""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NoRopeScaling(_Frozen):
    kind: Literal["none"] = "none"


class LinearRopeScaling(_Frozen):
    """Position interpolation: every frequency divided by `factor`."""

    kind: Literal["linear"] = "linear"
    factor: float = Field(gt=0)


class DynamicNTKRopeScaling(_Frozen):
    """NTK-aware base stretching that only kicks in once positions exceed the pretraining length."""

    kind: Literal["dynamic"] = "dynamic"
    factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)


class YarnRopeScaling(_Frozen):
    """YaRN: per-frequency blend of interpolation and extrapolation, plus an attention temperature."""

    kind: Literal["yarn"] = "yarn"
    factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


RopeScaling = Annotated[
    NoRopeScaling | LinearRopeScaling | DynamicNTKRopeScaling | YarnRopeScaling,
    Field(discriminator="kind"),
]


def _base_inv_freq(dim: int, theta: float, device: torch.device | None) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta**exponents)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    scaling: YarnRopeScaling, dim: int, theta: float, device: torch.device | None
) -> tuple[torch.Tensor, float]:
    factor = scaling.factor
    if scaling.attention_factor is not None:
        attention = scaling.attention_factor
    elif scaling.mscale and scaling.mscale_all_dim:
        attention = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
    else:
        attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # the frequency index whose wavelength fits `rotations` times into the original context
        return (
            dim
            * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    extrapolated = _base_inv_freq(dim, theta, device)
    interpolated = extrapolated / factor
    return interpolated * ramp + extrapolated * extrapolation_weight, float(attention)


def rope_frequencies(
    scaling: RopeScaling,
    dim: int,
    theta: float,
    *,
    seq_len: int,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] and the factor cos/sin are multiplied by, for sequences of `seq_len`.

    `seq_len` (the largest position + 1) only matters to dynamic NTK scaling, whose base grows with it.
    """
    if isinstance(scaling, NoRopeScaling):
        return _base_inv_freq(dim, theta, device), 1.0
    if isinstance(scaling, LinearRopeScaling):
        return _base_inv_freq(dim, theta, device) / scaling.factor, 1.0
    if isinstance(scaling, DynamicNTKRopeScaling):
        original = scaling.original_max_position_embeddings
        length = max(seq_len, original)
        stretched = theta * ((scaling.factor * length / original) - (scaling.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(dim, stretched, device), 1.0
    return _yarn(scaling, dim, theta, device)
