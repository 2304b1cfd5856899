"""Rotary position embeddings: cos/sin tables from position ids, and their application to q/k."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from d9d.kernels.backend import KernelBackend
from d9d.kernels.rotary import rope_qk
from d9d.kernels.rotary.reference import rotate_half
from d9d.modules.rotary.scaling import (
    DynamicNTKRopeScaling,
    NoRopeScaling,
    RopeScaling,
    rope_frequencies,
)

RotaryStyle = Literal["half", "interleaved"]


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


@dataclass(frozen=True)
class RotaryTables:
    """cos/sin for one batch, [batch, seq, head_dim], laid out for `style`.

    `backend` picks the fused Triton rotation of `apply_qk` (`d9d.kernels.rotary`, "half" style only) or the
    PyTorch reference; `with_backend` gives a copy for another choice (the decoder layer passes its own).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    style: RotaryStyle
    backend: KernelBackend = "auto"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotates `x` of shape [batch, seq, heads, head_dim] (always the PyTorch reference)."""
        cos, sin = self.cos.unsqueeze(2), self.sin.unsqueeze(2)
        rotated = rotate_half(x) if self.style == "half" else _rotate_interleaved(x)
        return x * cos + rotated * sin

    def apply_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k [batch, seq, heads, head_dim] in one kernel where `backend` allows it."""
        if self.style == "interleaved":
            return self.apply(q), self.apply(k)
        return rope_qk(q, k, self.cos, self.sin, backend=self.backend)

    def with_backend(self, backend: KernelBackend) -> RotaryTables:
        return RotaryTables(cos=self.cos, sin=self.sin, style=self.style, backend=backend)


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
