"""Unbiased fp32 -> bf16 rounding driven by explicit random bits."""

from __future__ import annotations

import torch
from torch import Tensor

_KEEP_BF16_BITS = -65536  # 0xFFFF0000 as int32: sign, exponent and the 7 mantissa bits bf16 keeps


def stochastic_round_bf16(x: Tensor, bits16: Tensor) -> Tensor:
    """Round fp32 `x` to bf16, up in magnitude with probability (dropped bits) / 2**16.

    Adding a uniform 16-bit integer to the fp32 pattern carries into the kept bits exactly when it
    exceeds the dropped fraction, so the expected result is `x` itself. Inf stays Inf (the carry never
    reaches the exponent) and NaN is passed through.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 expects float32, got {x.dtype}")
    rounded = ((x.view(torch.int32) + bits16) & _KEEP_BF16_BITS).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded).to(torch.bfloat16)
