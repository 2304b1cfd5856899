"""The fused CUDA path: one kernel reads param/grad/state once, updates in fp32, rounds, writes back.

Each program handles `ROWS` groups of 8 elements; one Philox block per group feeds the 8 elements'
16-bit dithers (the layout `philox_bits16` documents), so random bits cost no memory traffic.
Importing this module imports Triton; `TRITON_INTERPRET=1` must be set before the import to run the
kernel on CPU tensors (Triton reads it when `@triton.jit` decorates).
"""

# Triton reads a kernel's parameter annotations as argument types, so kernels stay unannotated and keep
# Triton's upper-case constexpr naming.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# ruff: noqa: ANN001, ANN202, N803

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from d9d.kernels.stochastic_rounding.adamw import AdamWScalars, check_operands
from d9d.kernels.stochastic_rounding.philox import (
    KEY_BUMP_A,
    KEY_BUMP_B,
    MULTIPLIER_A,
    MULTIPLIER_B,
    ROUNDS,
    split_key,
)
from d9d.kernels.stochastic_rounding.stream import RoundingStream, Target

_ROWS = 128
# Triton only reads module globals that are constexpr.
_MULTIPLIER_A = tl.constexpr(MULTIPLIER_A)
_MULTIPLIER_B = tl.constexpr(MULTIPLIER_B)
_KEY_BUMP_A = tl.constexpr(KEY_BUMP_A)
_KEY_BUMP_B = tl.constexpr(KEY_BUMP_B)
_PARAM = tl.constexpr(int(Target.PARAM))
_EXP_AVG = tl.constexpr(int(Target.EXP_AVG))
_EXP_AVG_SQ = tl.constexpr(int(Target.EXP_AVG_SQ))


@triton.jit
def _philox(c0, c1, c2, c3, k0, k1, ROUNDS: tl.constexpr):
    for _ in tl.static_range(ROUNDS):
        old_c0 = c0
        old_c2 = c2
        c0 = tl.umulhi(old_c2, _MULTIPLIER_B) ^ c1 ^ k0
        c2 = tl.umulhi(old_c0, _MULTIPLIER_A) ^ c3 ^ k1
        c1 = old_c2 * _MULTIPLIER_B
        c3 = old_c0 * _MULTIPLIER_A
        k0 = k0 + _KEY_BUMP_A
        k1 = k1 + _KEY_BUMP_B
    return c0, c1, c2, c3


@triton.jit
def _bits16(groups, lanes, step, tensor_index, tail3, k0, k1, ROUNDS: tl.constexpr):
    zero = groups * 0
    r0, r1, r2, r3 = _philox(groups, zero + step, zero + tensor_index, zero + tail3, k0, k1, ROUNDS)
    word = lanes // 2
    chosen = tl.where(
        word == 0,
        r0[:, None],
        tl.where(word == 1, r1[:, None], tl.where(word == 2, r2[:, None], r3[:, None])),
    )
    return (chosen >> ((lanes % 2) * 16).to(tl.uint32)) & 0xFFFF


@triton.jit
def _round_bf16(x, bits):
    rounded = ((x.to(tl.uint32, bitcast=True) + bits) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded).to(tl.bfloat16)


@triton.jit(
    do_not_specialize=["numel", "head", "first_group", "step", "tensor_index", "shard_bits", "k0", "k1"]
)
def _adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    numel,
    head,
    first_group,
    decay,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    step_size,
    bias2_sqrt,
    step,
    tensor_index,
    shard_bits,
    k0,
    k1,
    PARAM_BF16: tl.constexpr,
    STATE_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    ROUNDS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    lanes = tl.arange(0, 8)
    index = rows[:, None] * 8 + lanes[None, :] - head
    mask = (index >= 0) & (index < numel)

    g = tl.load(grad_ptr + index, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(param_ptr + index, mask=mask, other=0.0).to(tl.float32) * decay
    m = tl.load(exp_avg_ptr + index, mask=mask, other=0.0).to(tl.float32) * beta1 + g * one_minus_beta1
    v = tl.load(exp_avg_sq_ptr + index, mask=mask, other=0.0).to(tl.float32) * beta2 + g * g * one_minus_beta2
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    p = p - tl.div_rn(m, denom) * step_size

    groups = first_group.to(tl.uint32, bitcast=True) + rows.to(tl.uint32)
    step_u = step.to(tl.uint32, bitcast=True)
    index_u = tensor_index.to(tl.uint32, bitcast=True)
    shard_u = shard_bits.to(tl.uint32, bitcast=True)
    key0 = k0.to(tl.uint32, bitcast=True)
    key1 = k1.to(tl.uint32, bitcast=True)
    lanes_u = lanes[None, :].to(tl.uint32)

    if PARAM_BF16:
        bits = _bits16(groups, lanes_u, step_u, index_u, shard_u | _PARAM, key0, key1, ROUNDS)
        tl.store(param_ptr + index, _round_bf16(p, bits), mask=mask)
    else:
        tl.store(param_ptr + index, p, mask=mask)
    if STATE_BF16:
        bits_m = _bits16(groups, lanes_u, step_u, index_u, shard_u | _EXP_AVG, key0, key1, ROUNDS)
        tl.store(exp_avg_ptr + index, _round_bf16(m, bits_m), mask=mask)
        bits_v = _bits16(groups, lanes_u, step_u, index_u, shard_u | _EXP_AVG_SQ, key0, key1, ROUNDS)
        tl.store(exp_avg_sq_ptr + index, _round_bf16(v, bits_v), mask=mask)
    else:
        tl.store(exp_avg_ptr + index, m, mask=mask)
        tl.store(exp_avg_sq_ptr + index, v, mask=mask)


def _as_int32(value: int) -> int:
    """A uint32 passed through an int32 argument (Triton types Python ints by value)."""
    return value - 2**32 if value >= 2**31 else value


def adamw_step_triton(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    scalars: AdamWScalars,
    stream: RoundingStream,
) -> None:
    """Same contract as `adamw_step_torch`; needs contiguous tensors (the optimizer hands those)."""
    check_operands(param, grad, exp_avg, exp_avg_sq)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise TypeError(f"exp_avg ({exp_avg.dtype}) and exp_avg_sq ({exp_avg_sq.dtype}) must share a dtype")
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the Triton kernel")
    numel = param.numel()
    if numel == 0:
        return
    head = stream.first_index % 8
    first_group = stream.first_index // 8
    if first_group + (head + numel + 7) // 8 > 2**32:
        raise ValueError(f"element index {stream.first_index + numel} exceeds the 2**35 a stream can number")
    step_word, tensor_index, shard_bits = stream.counter_tail(Target.PARAM)  # the kernel ORs in the target
    k0, k1 = split_key(stream.seed)
    s = scalars
    grid = (triton.cdiv(head + numel, 8 * _ROWS),)
    _adamw_kernel[grid](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        numel,
        head,
        _as_int32(first_group),
        s.decay,
        s.beta1,
        1.0 - s.beta1,
        s.beta2,
        1.0 - s.beta2,
        s.eps,
        s.step_size,
        s.bias2_sqrt,
        _as_int32(step_word),
        _as_int32(tensor_index),
        _as_int32(shard_bits),
        _as_int32(k0),
        _as_int32(k1),
        PARAM_BF16=param.dtype == torch.bfloat16,
        STATE_BF16=exp_avg.dtype == torch.bfloat16,
        ROWS=_ROWS,
        ROUNDS=ROUNDS,
    )
