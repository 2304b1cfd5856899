"""Rotary embedding of q and k ("half" layout) in one Triton pass, forward or transposed (backward).

One launch for q and k; each program rotates a tile of (token, head) rows of one of them: it reads each
row's two halves and its token's cos/sin row directly (tables may be shared over the batch: batch stride
0; repeated table reads across heads hit the cache) — no `rotate_half` copy, no `cat`, no float32
temporaries in memory. Importing this module imports Triton; `TRITON_INTERPRET=1` must be set before the
import to run the kernels on CPU tensors.
"""

# Triton reads a kernel's parameter annotations as argument types, so kernels stay unannotated and keep
# Triton's upper-case constexpr naming.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# ruff: noqa: ANN001, ANN202, N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements per tile: (token, head) rows are stacked until a tile holds about this many.
_TILE = 4096


@triton.jit
def _rotate_rows(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    tile,
    rows,
    seq,
    table_batch_stride,
    table_seq_stride,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INVERSE: tl.constexpr,
):
    # a row is one (token, head) pair of x [batch · seq · heads, 2 · HALF]
    row = tile.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    token = row // HEADS
    d = tl.arange(0, BLOCK_D)
    mask = (row < rows)[:, None] & (d < HALF)[None, :]
    table = ((token // seq) * table_batch_stride + (token % seq) * table_seq_stride)[:, None] + d[None, :]
    c1 = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        # the transpose swaps the sine halves and their signs
        s1, s2 = -s2, -s1
    offsets = row[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + offsets + HALF, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    q_rows,
    k_rows,
    q_tiles,
    seq,
    table_batch_stride,
    table_seq_stride,
    HEADS_Q: tl.constexpr,
    HEADS_K: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INVERSE: tl.constexpr,
):
    # one launch for both: the first `q_tiles` programs rotate q, the rest k
    pid = tl.program_id(0)
    if pid < q_tiles:
        _rotate_rows(
            q_ptr, cos_ptr, sin_ptr, q_out_ptr, pid, q_rows, seq, table_batch_stride, table_seq_stride,
            HEADS_Q, HALF, BLOCK_R, BLOCK_D, INVERSE,
        )  # fmt: skip
    else:
        _rotate_rows(
            k_ptr, cos_ptr, sin_ptr, k_out_ptr, pid - q_tiles, k_rows, seq, table_batch_stride,
            table_seq_stride, HEADS_K, HALF, BLOCK_R, BLOCK_D, INVERSE,
        )  # fmt: skip


def rope_qk_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [batch, seq, heads_q, head_dim], k [batch, seq, heads_k, head_dim], tables [batch or 1, seq,
    head_dim] (cos and sin with the same strides); rotated copies in `promote(x, table)` dtype."""
    batch, seq, heads_q, head_dim = q.shape
    heads_k = k.shape[2]
    q, k = q.contiguous(), k.contiguous()
    cos = cos.expand(batch, seq, head_dim)
    sin = sin.expand(batch, seq, head_dim)
    if cos.stride() != sin.stride() or cos.stride(2) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
    k_out = torch.empty(k.shape, dtype=torch.promote_types(k.dtype, cos.dtype), device=k.device)
    q_rows, k_rows = batch * seq * heads_q, batch * seq * heads_k
    if (q_rows or k_rows) and head_dim:
        half = head_dim // 2
        block_d = triton.next_power_of_2(half)
        block_r = max(1, min(128, _TILE // block_d))
        q_tiles = triton.cdiv(q_rows, block_r)
        _rope_kernel[(q_tiles + triton.cdiv(k_rows, block_r),)](
            q,
            k,
            cos,
            sin,
            q_out,
            k_out,
            q_rows,
            k_rows,
            q_tiles,
            seq,
            cos.stride(0),
            cos.stride(1),
            HEADS_Q=heads_q,
            HEADS_K=heads_k,
            HALF=half,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            INVERSE=inverse,
        )
    return q_out, k_out
