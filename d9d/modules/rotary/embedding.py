"""Rotary position embeddings: cos/sin tables from position ids, and their application to q/k."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from d9d.modules.rotary.scaling import (
    DynamicNTKRopeScaling,
    NoRopeScaling,
    RopeScaling,
    rope_frequencies,
)

RotaryStyle = Literal["half", "interleaved"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


@dataclass(frozen=True)
class RotaryTables:
    """cos/sin for one batch, [batch, seq, head_dim], laid out for `style`."""

    cos: torch.Tensor
    sin: torch.Tensor
    style: RotaryStyle

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotates `x` of shape [batch, seq, heads, head_dim]."""
        cos, sin = self.cos.unsqueeze(2), self.sin.unsqueeze(2)
        rotated = _rotate_half(x) if self.style == "half" else _rotate_interleaved(x)
        return x * cos + rotated * sin


class RotaryEmbedding(nn.Module):
    """Computes RoPE tables from position ids.

    Frequencies are recomputed per call instead of cached in a buffer: they cost `head_dim / 2` values, and
    holding no state keeps the module trivially meta-device and pipeline-stage safe (and lets dynamic NTK
    scaling depend on the batch's positions). `style="half"` rotates the two halves of the head dim
    (Hugging Face / Qwen layout), `"interleaved"` rotates adjacent pairs (original RoFormer / Meta layout).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None = None,
        style: RotaryStyle = "half",
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling if scaling is not None else NoRopeScaling()
        self.style: RotaryStyle = style

    def reset_parameters(self) -> None:
        """Nothing to initialize: the tables are derived from positions."""

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """`position_ids` [batch, seq] → tables in `dtype`."""
        seq_len = 0
        if isinstance(self.scaling, DynamicNTKRopeScaling):
            seq_len = int(position_ids.max().item()) + 1
        inv_freq, attention_factor = rope_frequencies(
            self.scaling, self.head_dim, self.theta, seq_len=seq_len, device=position_ids.device
        )
        freqs = position_ids[..., None].float() * inv_freq
        if self.style == "half":
            angles = torch.cat((freqs, freqs), dim=-1)
        else:
            angles = freqs.repeat_interleave(2, dim=-1)
        cos = (angles.cos() * attention_factor).to(dtype)
        sin = (angles.sin() * attention_factor).to(dtype)
        return RotaryTables(cos=cos, sin=sin, style=self.style)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling.kind}, style={self.style}"
        )
