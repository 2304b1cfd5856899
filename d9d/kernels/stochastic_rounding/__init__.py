"""Stochastic-rounding AdamW update: a PyTorch reference and a fused Triton kernel drawing the same bits."""

from d9d.kernels.stochastic_rounding.adamw import AdamWScalars, adamw_step_torch
from d9d.kernels.stochastic_rounding.backend import KernelBackend, adamw_step, resolve_backend
from d9d.kernels.stochastic_rounding.philox import philox4x32, philox_bits16
from d9d.kernels.stochastic_rounding.rounding import stochastic_round_bf16
from d9d.kernels.stochastic_rounding.stream import RoundingStream, Target

__all__ = [
    "AdamWScalars",
    "KernelBackend",
    "RoundingStream",
    "Target",
    "adamw_step",
    "adamw_step_torch",
    "philox4x32",
    "philox_bits16",
    "resolve_backend",
    "stochastic_round_bf16",
]
