"""One AdamW update of one tensor, computed in fp32 and stored with stochastic rounding.

`adamw_step_torch` is the reference: plain tensor ops, each rounded to fp32 on its own, in the same order
as the Triton kernel, so under `TRITON_INTERPRET=1` both agree bit for bit. On CUDA the kernel may fuse
multiply-adds, so there they agree to fp32 rounding error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from d9d.kernels.stochastic_rounding.rounding import stochastic_round_bf16
from d9d.kernels.stochastic_rounding.stream import RoundingStream, Target

PARAM_DTYPES = (torch.bfloat16, torch.float32)
STATE_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AdamWScalars:
    """Hyperparameters of one update; the derived factors are computed once, in float64."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    def __post_init__(self) -> None:
        if self.step < 1:
            raise ValueError(f"step={self.step} must be >= 1 (bias correction divides by 1 - beta**step)")

    @property
    def decay(self) -> float:
        return 1.0 - self.lr * self.weight_decay

    @property
    def step_size(self) -> float:
        return self.lr / (1.0 - self.beta1**self.step)

    @property
    def bias2_sqrt(self) -> float:
        return math.sqrt(1.0 - self.beta2**self.step)


def check_operands(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
    """Refuse dtypes and shapes the update does not handle, before touching anything."""
    if param.dtype not in PARAM_DTYPES:
        raise TypeError(f"param dtype {param.dtype} is not supported (use bfloat16 or float32)")
    for name, state in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if state.dtype not in STATE_DTYPES:
            raise TypeError(f"{name} dtype {state.dtype} is not supported (use bfloat16 or float32)")
    for name, other in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if other.shape != param.shape:
            raise ValueError(
                f"{name} shape {tuple(other.shape)} differs from param shape {tuple(param.shape)}"
            )
        if other.device != param.device:
            raise ValueError(f"{name} is on {other.device}, param on {param.device}")


def _store(dst: Tensor, value: Tensor, stream: RoundingStream, target: Target) -> None:
    if dst.dtype == torch.bfloat16:
        value = stochastic_round_bf16(
            value, stream.bits16(value.numel(), target, value.device).view_as(value)
        )
    dst.copy_(value)


@torch.no_grad()
def adamw_step_torch(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    scalars: AdamWScalars,
    stream: RoundingStream,
) -> None:
    """Update `param`, `exp_avg`, `exp_avg_sq` in place; bf16 destinations are stochastically rounded."""
    check_operands(param, grad, exp_avg, exp_avg_sq)
    s = scalars
    g = grad.float()
    p = param.float() * s.decay
    m = exp_avg.float() * s.beta1 + g * (1.0 - s.beta1)
    v = exp_avg_sq.float() * s.beta2 + g * g * (1.0 - s.beta2)
    denom = torch.sqrt(v) / s.bias2_sqrt + s.eps
    p = p - m / denom * s.step_size
    _store(param, p, stream, Target.PARAM)
    _store(exp_avg, m, stream, Target.EXP_AVG)
    _store(exp_avg_sq, v, stream, Target.EXP_AVG_SQ)
