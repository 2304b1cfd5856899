"""Rotary embedding of q and k ("half" layout): Triton on CUDA, PyTorch elsewhere. Used by
`d9d.modules.rotary.RotaryTables.apply_qk`; the "interleaved" layout always takes the reference."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from d9d.kernels.backend import KernelBackend, choose_kernel
from d9d.kernels.rotary.reference import rope_torch

_FAMILY = "rotary"
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _unsupported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    if any(isinstance(t, DTensor) for t in (q, k, cos, sin)):
        return "DTensor input (the kernel takes local tensors)"
    if any(t.dtype not in _KERNEL_DTYPES for t in (q, k, cos, sin)):
        return (
            f"dtypes q {q.dtype}, k {k.dtype}, tables {cos.dtype} (kernels take bfloat16, float16, float32)"
        )
    if cos.requires_grad or sin.requires_grad:
        return "the cos/sin tables require grad (the kernel differentiates q and k only)"
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} are not [batch, seq, heads, head_dim] alike"
    batch, seq, _, head_dim = q.shape
    if (
        cos.shape != sin.shape
        or cos.dim() != 3
        or cos.shape[0] not in (1, batch)
        or cos.shape[1:] != (seq, head_dim)
    ):
        return f"tables {tuple(cos.shape)} do not fit q {tuple(q.shape)} ([batch or 1, seq, head_dim])"
    if head_dim % 2:
        return f"odd head_dim {head_dim}"
    if len({t.device for t in (q, k, cos, sin)}) != 1:
        return "inputs on different devices"
    return None


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    backend: KernelBackend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k [batch, seq, heads, head_dim] ("half" layout) by tables [batch, seq, head_dim]."""
    if choose_kernel(_FAMILY, backend, q.device, lambda: _unsupported(q, k, cos, sin)) == "torch":
        return rope_torch(q, cos, sin), rope_torch(k, cos, sin)
    from d9d.kernels.rotary.ops import rope_qk_op

    q_out, k_out = rope_qk_op(q, k, cos, sin, False)
    return q_out, k_out


__all__ = ["rope_qk"]
