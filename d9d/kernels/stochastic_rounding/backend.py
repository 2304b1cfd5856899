"""Choosing between the fused Triton kernel and the PyTorch reference."""

from __future__ import annotations

from torch import Tensor

from d9d.kernels.backend import KernelBackend, resolve_backend
from d9d.kernels.stochastic_rounding.adamw import AdamWScalars, adamw_step_torch
from d9d.kernels.stochastic_rounding.stream import RoundingStream

__all__ = ["KernelBackend", "adamw_step", "resolve_backend"]


def adamw_step(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    scalars: AdamWScalars,
    stream: RoundingStream,
    backend: KernelBackend = "auto",
) -> None:
    """One stochastic-rounding AdamW update of one tensor, in place, on the chosen backend."""
    if resolve_backend(backend, param.device) == "torch":
        adamw_step_torch(param, grad, exp_avg, exp_avg_sq, scalars, stream)
        return
    from d9d.kernels.stochastic_rounding.adamw_triton import adamw_step_triton

    adamw_step_triton(param, grad, exp_avg, exp_avg_sq, scalars, stream)
