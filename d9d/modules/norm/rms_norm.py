"""Root-mean-square layer normalization."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 and cast back before the scale.

    `zero_centered=True` stores the scale as an offset from one (`out = x̂ · (1 + w)`, initialized to zero),
    which keeps weight decay from pulling the effective scale towards zero.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.zero_centered:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        scale = 1.0 + self.weight if self.zero_centered else self.weight
        return scale * normed

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered={self.zero_centered}"
