"""SwiGLU's gate in plain PyTorch, `silu(gate) · up`: the kernels' reference.

`swiglu_backward_torch` is the gradient written out by hand (the custom op's CPU implementation and a
check of the kernel's formula): with `σ = sigmoid(gate)`, `d/dgate = grad · up · σ · (1 + gate · (1 − σ))`
and `d/dup = grad · silu(gate)`, in float32 and rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_forward_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The forward as the kernel computes it: float32, one rounding."""
    return (F.silu(gate.float()) * up.float()).to(torch.promote_types(gate.dtype, up.dtype))


def swiglu_backward_torch(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, dy = gate.float(), up.float(), grad_out.float()
    sig = torch.sigmoid(g)
    grad_gate = dy * u * sig * (1.0 + g * (1.0 - sig))
    grad_up = dy * g * sig
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)
