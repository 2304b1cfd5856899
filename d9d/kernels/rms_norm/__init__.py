"""RMSNorm, optionally fused with the residual add before it: Triton on CUDA, PyTorch elsewhere.

Used by `d9d.modules.norm.RMSNorm` (block norms and the per-head q/k norms, normalized over the last dim).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from d9d.kernels.backend import KernelBackend, choose_kernel
from d9d.kernels.rms_norm.reference import add_rms_norm_torch, rms_norm_torch

_FAMILY = "rms_norm"
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_N = 65536  # the kernels normalize a row in one block; triton_kernels.MAX_N


def _unsupported(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> str | None:
    if any(isinstance(t, DTensor) for t in (x, residual, weight)):
        return "DTensor input (the kernel takes local tensors)"
    if x.dtype not in _KERNEL_DTYPES or weight.dtype not in _KERNEL_DTYPES:
        return f"dtype {x.dtype} / weight {weight.dtype} (kernels take bfloat16, float16, float32)"
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape):
        return (
            f"residual {residual.dtype}{tuple(residual.shape)} differs from input {x.dtype}{tuple(x.shape)}"
        )
    if x.dim() == 0 or weight.shape != x.shape[-1:]:
        return f"weight shape {tuple(weight.shape)} does not match the last dim of {tuple(x.shape)}"
    if x.shape[-1] > _MAX_N:
        return f"row length {x.shape[-1]} > {_MAX_N}"
    if x.device != weight.device:
        return f"input on {x.device}, weight on {weight.device}"
    return None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
    backend: KernelBackend = "auto",
) -> torch.Tensor:
    """`x / rms(x) · weight` over the last dim (`· (1 + weight)` when `zero_centered`)."""
    if choose_kernel(_FAMILY, backend, x.device, lambda: _unsupported(x, None, weight)) == "torch":
        return rms_norm_torch(x, weight, eps, zero_centered)
    from d9d.kernels.rms_norm.ops import rms_norm_op

    out: torch.Tensor = rms_norm_op(x, weight, eps, zero_centered)[0]
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = False,
    backend: KernelBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass: the pre-norm block's residual add and the next
    sublayer's norm."""
    if choose_kernel(_FAMILY, backend, x.device, lambda: _unsupported(x, residual, weight)) == "torch":
        return add_rms_norm_torch(x, residual, weight, eps, zero_centered)
    from d9d.kernels.rms_norm.ops import add_rms_norm_op

    out, total, _ = add_rms_norm_op(x, residual, weight, eps, zero_centered)
    return out, total


__all__ = ["add_rms_norm", "rms_norm"]
