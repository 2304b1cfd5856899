"""Triton kernels for moving token copies between token order and expert-grouped rows.

One program per (token, hidden block); the k copies of a token are handled inside the program, so the
combine sums them in registers (deterministic, no atomics) and each row is written exactly once.
A negative slot row is an absent copy: its loads and stores are masked off (no memory traffic), so the
expert-parallel exchange can pass [tokens, k] slots of which only a rank's own copies are present.
Importing this module imports Triton; `TRITON_INTERPRET=1` must be set before the import to run the
kernels on CPU tensors.
"""

# Triton reads a kernel's parameter annotations as argument types, so kernels stay unannotated and keep
# Triton's upper-case constexpr naming.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# ruff: noqa: ANN001, ANN202, N803

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # hidden columns per program; tests lower it to exercise several blocks


@triton.jit
def _scatter_rows_kernel(
    x_ptr, w_ptr, slot_rows_ptr, out_ptr, hidden, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + token * hidden + cols, mask=mask).to(tl.float32)
    for j in tl.static_range(K):
        row = tl.load(slot_rows_ptr + token * K + j)
        value = x
        if HAS_W:
            value = x * tl.load(w_ptr + token * K + j).to(tl.float32)
        present = cols < tl.where(row >= 0, hidden, 0)  # an absent slot (row < 0) stores nothing
        tl.store(out_ptr + row * hidden + cols, value.to(out_ptr.dtype.element_ty), mask=present)


@triton.jit
def _gather_sum_kernel(
    rows_ptr, w_ptr, slot_rows_ptr, out_ptr, hidden, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(slot_rows_ptr + token * K + j)
        present = cols < tl.where(row >= 0, hidden, 0)  # an absent slot (row < 0) loads nothing
        value = tl.load(rows_ptr + row * hidden + cols, mask=present, other=0.0).to(tl.float32)
        if HAS_W:
            value = value * tl.load(w_ptr + token * K + j).to(tl.float32)
        acc += value
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _slot_dot_kernel(
    rows_ptr, grad_ptr, slot_rows_ptr, out_ptr, hidden, K: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    for j in tl.static_range(K):
        row = tl.load(slot_rows_ptr + token * K + j)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        stop = tl.where(row >= 0, hidden, 0)  # an absent slot reads nothing and stores 0
        for start in range(0, stop, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < hidden
            r = tl.load(rows_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(grad_ptr + token * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            acc += r * g
        tl.store(out_ptr + token * K + j, tl.sum(acc, axis=0))


@triton.jit
def _block_regroup_kernel(
    counts_ptr,
    out_ptr,
    SOURCES: tl.constexpr,
    EXPERTS: tl.constexpr,
    BLOCKS: tl.constexpr,
    BLOCKS_P2: tl.constexpr,
    ROWS: tl.constexpr,
):
    # One program per arriving block b = (chunk, source, expert): it reads every block's count (a few
    # hundred), sums those before b in arrival order and in target (chunk, expert, source) order, and
    # writes its rows' new positions.
    b = tl.program_id(0)
    j = tl.arange(0, BLOCKS_P2)
    valid = j < BLOCKS
    counts = tl.load(counts_ptr + j, mask=valid, other=0)
    src_start = tl.sum(tl.where(j < b, counts, 0), axis=0)
    per_chunk = SOURCES * EXPERTS
    target_j = (j // per_chunk) * per_chunk + (j % EXPERTS) * SOURCES + (j // EXPERTS) % SOURCES
    target_b = (b // per_chunk) * per_chunk + (b % EXPERTS) * SOURCES + (b // EXPERTS) % SOURCES
    dst_start = tl.sum(tl.where(valid & (target_j < target_b), counts, 0), axis=0)
    n = tl.load(counts_ptr + b)
    for start in range(0, n, ROWS):
        r = start + tl.arange(0, ROWS)
        tl.store(out_ptr + src_start + r, dst_start + r, mask=r < n)


_REGROUP_ROWS = 1024  # rows per loop iteration of a block; tests lower it to exercise several


def block_regroup_slots_triton(counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    chunks, sources, experts = counts.shape
    blocks = chunks * sources * experts
    out = torch.empty(num_rows, dtype=torch.int64, device=counts.device)
    _block_regroup_kernel[(blocks,)](
        counts.to(torch.int64).contiguous(),
        out,
        SOURCES=sources,
        EXPERTS=experts,
        BLOCKS=blocks,
        BLOCKS_P2=max(16, triton.next_power_of_2(blocks)),
        ROWS=_REGROUP_ROWS,
    )
    return out


def _launch_rows(
    kernel: Any, src: torch.Tensor, weights: torch.Tensor | None, slot_rows: torch.Tensor, out: torch.Tensor
) -> None:
    """One program per (token, hidden block) of a scatter / gather kernel."""
    tokens, k = slot_rows.shape
    hidden = src.shape[1]
    if tokens and hidden:
        w = weights.contiguous() if weights is not None else src  # placeholder pointer when HAS_W is off
        kernel[(tokens, triton.cdiv(hidden, _BLOCK))](
            src.contiguous(),
            w,
            slot_rows.contiguous(),
            out,
            hidden,
            K=k,
            HAS_W=weights is not None,
            BLOCK=_BLOCK,
        )


def scatter_rows_triton(
    x: torch.Tensor, weights: torch.Tensor | None, slot_rows: torch.Tensor, num_rows: int
) -> torch.Tensor:
    # Rows no slot names (alignment padding) must read as zero; a buffer every slot fills needs no clear
    # (as many rows as slots: the callers guarantee no slot is absent then, `permute_tokens`).
    full = num_rows == slot_rows.numel()
    out = x.new_empty(num_rows, x.shape[1]) if full else x.new_zeros(num_rows, x.shape[1])
    _launch_rows(_scatter_rows_kernel, x, weights, slot_rows, out)
    return out


def gather_sum_triton(
    rows: torch.Tensor, weights: torch.Tensor | None, slot_rows: torch.Tensor
) -> torch.Tensor:
    out = rows.new_empty(slot_rows.shape[0], rows.shape[1])
    _launch_rows(_gather_sum_kernel, rows, weights, slot_rows, out)
    return out


def slot_dot_triton(rows: torch.Tensor, grad: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
    tokens, k = slot_rows.shape
    out = torch.empty(tokens, k, dtype=torch.float32, device=rows.device)
    if tokens:
        _slot_dot_kernel[(tokens,)](
            rows.contiguous(),
            grad.contiguous(),
            slot_rows.contiguous(),
            out,
            rows.shape[1],
            K=k,
            BLOCK=_BLOCK,
        )
    return out
