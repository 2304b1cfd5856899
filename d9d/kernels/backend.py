"""Choosing between a Triton kernel and its PyTorch reference (shared by every kernel family)."""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import torch

KernelBackend = Literal["auto", "triton", "torch"]


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: KernelBackend, device: torch.device) -> Literal["triton", "torch"]:
    """`auto` takes Triton on CUDA when it is installed, the reference elsewhere.

    An explicit `triton` is honoured on any device, so the interpreter (`TRITON_INTERPRET=1`) can run the
    kernel on CPU tensors.
    """
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and has_triton() else "torch"
    if backend != "triton":
        raise ValueError(f"backend={backend!r} must be one of 'auto', 'triton', 'torch'")
    if not has_triton():
        raise RuntimeError("backend='triton' was requested but triton is not installed")
    return "triton"
