"""The pre-norm decoder layer the catalogue's families share: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.backend import KernelBackend
from d9d.modules.attention import AttentionMask
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe import MoELayer
from d9d.modules.norm import RMSNorm
from d9d.modules.rotary import RotaryTables


class PreNormDecoderLayer(nn.Module):
    """A family's layer sets `input_layernorm`, `self_attn` (called as `(x, rotary, mask)`),
    `post_attention_layernorm`, `mlp` (a SwiGLU or an `MoELayer`) and `kernel_backend` (the rotary kernel's
    backend) in its `__init__`. The attention output's residual add and the second norm run as one fused
    add + norm (`RMSNorm.add_forward`); an MoE layer gets the batch's padding to keep it out of its balancing
    loss."""

    input_layernorm: RMSNorm
    self_attn: nn.Module
    post_attention_layernorm: RMSNorm
    mlp: SwiGLU | MoELayer
    kernel_backend: KernelBackend

    def reset_parameters(self) -> None:
        self.input_layernorm.reset_parameters()
        self.self_attn.reset_parameters()  # type: ignore[operator]
        self.post_attention_layernorm.reset_parameters()
        self.mlp.reset_parameters()

    def forward(self, hidden: torch.Tensor, rotary: RotaryTables, mask: AttentionMask) -> torch.Tensor:
        attended = self.self_attn(
            self.input_layernorm(hidden), rotary.with_backend(self.kernel_backend), mask
        )
        normed, hidden = self.post_attention_layernorm.add_forward(attended, hidden)
        ffn = self.mlp(normed, mask.padding) if isinstance(self.mlp, MoELayer) else self.mlp(normed)
        out: torch.Tensor = hidden + ffn
        return out
