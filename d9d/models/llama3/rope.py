"""Llama 3.1's RoPE frequency scaling: long wavelengths divided by `factor`, short ones kept, the band between
`original_max_position_embeddings / high_freq_factor` and `/ low_freq_factor` interpolated smoothly."""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from d9d.modules.rotary import NoRopeScaling, RotaryTables, rope_frequencies


class Llama3RopeScaling(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["llama3"] = "llama3"
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Llama3RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor={self.high_freq_factor} must exceed low_freq_factor={self.low_freq_factor}"
            )
        return self


def llama3_inv_freq(
    scaling: Llama3RopeScaling, head_dim: int, theta: float, device: torch.device | None = None
) -> torch.Tensor:
    """The scaled inverse frequencies, [head_dim / 2] float32."""
    inv_freq, _ = rope_frequencies(NoRopeScaling(), head_dim, theta, seq_len=0, device=device)
    wavelength = 2 * math.pi / inv_freq
    context = scaling.original_max_position_embeddings
    long_wave = wavelength > context / scaling.low_freq_factor  # beyond the pretraining context: interpolate
    short_wave = wavelength < context / scaling.high_freq_factor  # well inside it: keep
    # between the two, blend linearly in (context / wavelength)
    blend = (context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    scaled = torch.where(long_wave, inv_freq / scaling.factor, smoothed)
    return torch.where(short_wave, inv_freq, scaled)


class Llama3RotaryEmbedding(nn.Module):
    """RoPE tables ("half" layout) with the Llama 3.1 frequencies, recomputed per call like
    `d9d.modules.rotary.RotaryEmbedding` (no state: meta-device and pipeline-stage safe)."""

    def __init__(self, head_dim: int, theta: float, scaling: Llama3RopeScaling) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling

    def reset_parameters(self) -> None:
        """Nothing to initialize: the tables are derived from positions."""

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        inv_freq = llama3_inv_freq(self.scaling, self.head_dim, self.theta, position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return RotaryTables(cos=angles.cos().to(dtype), sin=angles.sin().to(dtype), style="half")

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling=llama3(factor={self.scaling.factor})"
