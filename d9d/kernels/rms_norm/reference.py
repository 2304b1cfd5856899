"""RMSNorm (with an optional residual add before it) in plain PyTorch: the kernels' reference.

Statistics in float32; the normalized value is cast back to the input's dtype before the scale, as Hugging
Face's Qwen3 does (HF parity depends on it), so the result has the promoted dtype of input and weight.
`rms_norm_backward_torch` is the gradient written out by hand: the custom op's CPU implementation (used by
compiled CPU graphs that force the Triton backend) and a check of the kernel's formula.
"""

from __future__ import annotations

import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    scale = 1.0 + weight if zero_centered else weight
    return scale * normed


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the sum is the residual stream the next sublayer adds to."""
    total = x + residual
    return rms_norm_torch(total, weight, eps, zero_centered), total


def rms_norm_forward_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, rstd): the forward the kernel computes, in float32 with one rounding at the end."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
    scale = weight.float() + 1.0 if zero_centered else weight.float()
    out = (x32 * rstd[..., None] * scale).to(torch.promote_types(x.dtype, weight.dtype))
    return out, rstd


def rms_norm_backward_torch(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight) of `y = x · rstd · scale` with `rstd = (mean(x²) + eps)^-½` per row:
    `grad_x = rstd · (g − x̂ · mean(g · x̂))` with `g = grad_y · scale`, `x̂ = x · rstd`."""
    x32, dy = x.float(), grad_out.float()
    scale = weight.float() + 1.0 if zero_centered else weight.float()
    xhat = x32 * rstd[..., None]
    g = dy * scale
    grad_x = rstd[..., None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    grad_w = (dy * xhat).reshape(-1, x.shape[-1]).sum(0)
    return grad_x.to(x.dtype), grad_w.to(weight.dtype)
