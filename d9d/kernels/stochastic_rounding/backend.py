"""Choosing between the fused Triton kernel and the PyTorch reference."""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import torch
from torch import Tensor

from d9d.kernels.stochastic_rounding.adamw import AdamWScalars, adamw_step_torch
from d9d.kernels.stochastic_rounding.stream import RoundingStream

KernelBackend = Literal["auto", "triton", "torch"]


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: KernelBackend, device: torch.device) -> Literal["triton", "torch"]:
    """`auto` takes Triton on CUDA when it is installed, the reference elsewhere.

    An explicit `triton` is honoured on any device, so the interpreter (`TRITON_INTERPRET=1`) can run the
    kernel on CPU tensors.
    """
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and _has_triton() else "torch"
    if backend != "triton":
        raise ValueError(f"backend={backend!r} must be one of 'auto', 'triton', 'torch'")
    if not _has_triton():
        raise RuntimeError("backend='triton' was requested but triton is not installed")
    return "triton"


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
