"""Rotary embedding of q and k ("half" layout) in one Triton pass, forward or transposed (backward).

One program per token rotates all of that token's q heads and k heads: it loads the token's cos/sin row
once (tables may be shared over the batch: batch stride 0) and reads each head's two halves directly —
no `rotate_half` copy, no `cat`, no float32 temporaries in memory. Importing this module imports Triton;
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


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, c1, c2, s1, s2, d, d_ok, H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr
):
    heads = tl.arange(0, BLOCK_H)
    offsets = heads[:, None] * (2 * HALF) + d[None, :]
    mask = (heads < H)[:, None] & d_ok[None, :]
    x1 = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * c1[None, :] - x2 * s1[None, :]
    out2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(out_ptr + offsets, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + offsets + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    seq,
    table_batch_stride,
    table_seq_stride,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    INVERSE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    table = (token // seq) * table_batch_stride + (token % seq) * table_seq_stride
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    c1 = tl.load(cos_ptr + table + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    if INVERSE:
        # the transpose swaps the sine halves and their signs
        s1, s2 = -s2, -s1
    q_row = token * (HQ * 2 * HALF)
    k_row = token * (HK * 2 * HALF)
    _rotate_heads(q_ptr + q_row, q_out_ptr + q_row, c1, c2, s1, s2, d, d_ok, HQ, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + k_row, k_out_ptr + k_row, c1, c2, s1, s2, d, d_ok, HK, HALF, BLOCK_HK)


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
    tokens = batch * seq
    if tokens and head_dim:
        half = head_dim // 2
        _rope_kernel[(tokens,)](
            q,
            k,
            cos,
            sin,
            q_out,
            k_out,
            seq,
            cos.stride(0),
            cos.stride(1),
            HQ=heads_q,
            HK=heads_k,
            HALF=half,
            BLOCK_D=triton.next_power_of_2(half),
            BLOCK_HQ=triton.next_power_of_2(heads_q),
            BLOCK_HK=triton.next_power_of_2(heads_k),
            INVERSE=inverse,
        )
    return q_out, k_out
