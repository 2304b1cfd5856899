"""The fused CUDA path: one program per row streams the row's logits in blocks.

Forward reads the row once (online log-sum-exp: running maximum and rescaled sum), then the label's
logit; backward reads it once more and writes the gradient in the logits' dtype, in place when asked —
instead of the reference's float32 copies of the whole chunk. Importing this module imports Triton;
`TRITON_INTERPRET=1` must be set before the import to run the kernels on CPU tensors.
"""

# Triton reads a kernel's parameter annotations as argument types, so kernels stay unannotated and keep
# Triton's upper-case constexpr naming.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# ruff: noqa: ANN001, ANN202, N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

from d9d.kernels.cross_entropy.reference import accumulation_dtype

_BLOCK = 4096
# The vocabulary size is a compile-time constant: one model compiles each kernel once, and the loop
# bounds are plain integers (which the interpreter of some Triton versions needs).


@triton.jit
def _rows_kernel(
    logits_ptr,
    row_stride,
    labels_ptr,
    lse_ptr,
    loss_ptr,
    ignore_index,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, VOCAB, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(base + offsets, mask=offsets < VOCAB, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    target = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))


@triton.jit
def _grad_kernel(
    logits_ptr,
    row_stride,
    out_ptr,
    out_stride,
    lse_ptr,
    labels_ptr,
    scale_ptr,
    ignore_index,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    out = out_ptr + row * out_stride
    label = tl.load(labels_ptr + row)
    scale = tl.where(label != ignore_index, tl.load(scale_ptr + row).to(tl.float32), 0.0)
    lse = tl.load(lse_ptr + row)
    for start in range(0, VOCAB, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < VOCAB
        x = tl.load(base + offsets, mask=mask, other=0.0).to(tl.float32)
        probs = tl.exp(x - lse)
        probs = tl.where(offsets == label, probs - 1.0, probs)
        tl.store(out + offsets, (probs * scale).to(out_ptr.dtype.element_ty), mask=mask)


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows, got {tuple(logits.shape)}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match {logits.shape[0]} rows")


def ce_rows_triton(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, labels)
    rows, vocab = logits.shape
    dtype = accumulation_dtype(logits.dtype)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    loss = torch.empty_like(lse)
    if rows:
        _rows_kernel[(rows,)](
            logits, logits.stride(0), labels.contiguous(), lse, loss, ignore_index, VOCAB=vocab, BLOCK=_BLOCK
        )
    return lse.to(dtype), loss.to(dtype)


def ce_grad_triton(
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    *,
    in_place: bool = False,
) -> torch.Tensor:
    _check(logits, labels)
    rows, vocab = logits.shape
    out = logits if in_place else torch.empty_like(logits)
    if rows:
        _grad_kernel[(rows,)](
            logits,
            logits.stride(0),
            out,
            out.stride(0),
            lse.float().contiguous(),
            labels.contiguous(),
            scale.float().contiguous(),
            ignore_index,
            VOCAB=vocab,
            BLOCK=_BLOCK,
        )
    return out
