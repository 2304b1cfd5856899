"""Root-mean-square layer normalization."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from d9d.kernels.backend import KernelBackend
from d9d.kernels.rms_norm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 and cast back before the scale.

    `zero_centered=True` stores the scale as an offset from one (`out = x̂ · (1 + w)`, initialized to zero),
    which keeps weight decay from pulling the effective scale towards zero. `backend` picks the fused Triton
    kernel or the PyTorch reference (`d9d.kernels.rms_norm`); it is a plain attribute, so the model that
    owns the norm can set it after construction. `add_forward` fuses the residual add in front.
    """

    def __init__(
        self, dim: int, eps: float = 1e-6, *, zero_centered: bool = False, backend: KernelBackend = "auto"
    ) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.backend: KernelBackend = backend
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.zero_centered:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)`, or with `residual` the pair `(norm(x + residual), x + residual)`."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, zero_centered=self.zero_centered, backend=self.backend)
        return add_rms_norm(
            x, residual, self.weight, self.eps, zero_centered=self.zero_centered, backend=self.backend
        )

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a pre-norm block's residual add and this norm in one pass.

        Goes through the module call, not `forward` directly: parallel plans swap the weight for a view
        (a local tensor, a gradient-summing identity) in forward hooks, which must run here too."""
        out: tuple[torch.Tensor, torch.Tensor] = self(x, residual)
        return out

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered={self.zero_centered}"
