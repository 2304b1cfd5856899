"""SwiGLU's gate `silu(gate) · up`: Triton on CUDA, PyTorch elsewhere. Used by `d9d.modules.mlp.SwiGLU`."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from d9d.kernels.backend import KernelBackend, choose_kernel
from d9d.kernels.swiglu.reference import swiglu_torch

_FAMILY = "swiglu"
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _unsupported(gate: torch.Tensor, up: torch.Tensor) -> str | None:
    if isinstance(gate, DTensor) or isinstance(up, DTensor):
        return "DTensor input (the kernel takes local tensors)"
    if gate.dtype not in _KERNEL_DTYPES or up.dtype != gate.dtype:
        return f"dtypes {gate.dtype} / {up.dtype} (kernels take one of bfloat16, float16, float32)"
    if gate.shape != up.shape:
        return f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape (no broadcasting)"
    if gate.device != up.device:
        return f"gate on {gate.device}, up on {up.device}"
    return None


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: KernelBackend = "auto") -> torch.Tensor:
    """`silu(gate) · up`."""
    if choose_kernel(_FAMILY, backend, gate.device, lambda: _unsupported(gate, up)) == "torch":
        return swiglu_torch(gate, up)
    from d9d.kernels.swiglu.ops import swiglu_op

    out: torch.Tensor = swiglu_op(gate, up)
    return out


__all__ = ["swiglu"]
