"""Row-wise cross-entropy of a logits chunk (log-sum-exp, loss, gradient): Triton on CUDA, PyTorch
elsewhere. Used by `d9d.modules.heads.linear_cross_entropy`."""

from __future__ import annotations

import torch

from d9d.kernels.backend import KernelBackend, resolve_backend
from d9d.kernels.cross_entropy.reference import accumulation_dtype, ce_grad_torch, ce_rows_torch

# The kernels compute in float32: wider logits (float64 in tests) stay on the reference.
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _use_triton(logits: torch.Tensor, backend: KernelBackend) -> bool:
    return resolve_backend(backend, logits.device) == "triton" and logits.dtype in _KERNEL_DTYPES


def ce_rows(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, backend: KernelBackend = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, loss) per row of `logits` [rows, vocab], in at least float32; loss 0 where ignored."""
    if _use_triton(logits, backend):
        from d9d.kernels.cross_entropy.triton_kernels import ce_rows_triton

        return ce_rows_triton(logits, labels, ignore_index)
    return ce_rows_torch(logits, labels, ignore_index)


def ce_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    backend: KernelBackend = "auto",
) -> torch.Tensor:
    """Gradient of `sum(scale * loss)` w.r.t. `logits`, in the logits' dtype. May overwrite `logits`
    (the Triton path writes in place): the caller must not need them afterwards."""
    if _use_triton(logits, backend):
        from d9d.kernels.cross_entropy.triton_kernels import ce_grad_triton

        return ce_grad_triton(logits, lse, labels, scale, ignore_index, in_place=True)
    return ce_grad_torch(logits, lse, labels, scale, ignore_index)


__all__ = ["accumulation_dtype", "ce_grad", "ce_rows"]
