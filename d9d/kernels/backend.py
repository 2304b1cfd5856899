"""Choosing between a Triton kernel and its PyTorch reference (shared by every kernel family)."""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from collections.abc import Callable
from typing import Literal

import torch

KernelBackend = Literal["auto", "triton", "torch"]


# Looked up once at import (without importing triton): compiled blocks call `resolve_backend` while dynamo
# traces them, and a module constant traces as a constant where an import-system query would not.
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def has_triton() -> bool:
    return _HAS_TRITON


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


logger = logging.getLogger("d9d.kernels")

# One log line per (kernel family, choice) and one warning per (family, fallback reason) for the whole
# process: the choice is made on every call, the user needs to hear about it once.
_LOGGED: set[tuple[str, str]] = set()
_WARNED: set[tuple[str, str]] = set()


def _log_choice_once(family: str, requested: KernelBackend, choice: str) -> None:
    key = (family, f"{requested}->{choice}")
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("%s kernels: backend=%s runs the %s path", family, requested, choice)


def _warn_fallback_once(family: str, reason: str) -> None:
    if (family, reason) not in _WARNED:
        _WARNED.add((family, reason))
        warnings.warn(
            f"{family}: the Triton kernel does not support this input ({reason}); using the PyTorch "
            "reference instead",
            RuntimeWarning,
            stacklevel=4,
        )


# Dynamo cannot trace `warnings.warn`: inside a compiled region the warning is a graph break, which only the
# misconfigured case (an explicit `triton` on an input the kernel rejects) pays — loudly, where
# `fullgraph=True` turns it into an error, rather than switching silently.
_warn_fallback_once_compiled: Callable[[str, str], None] = torch.compiler.disable(_warn_fallback_once)


def choose_kernel(
    family: str,
    backend: KernelBackend,
    device: torch.device,
    unsupported: Callable[[], str | None],
) -> Literal["triton", "torch"]:
    """Resolve `backend` for one call of a fused elementwise kernel family (RMSNorm, SwiGLU, RoPE).

    Inside a `torch.compile`d region `auto` takes the reference: inductor fuses those plain ops into its
    own kernels (and into their neighbours, which an opaque custom op would prevent), so the hand-written
    kernel buys nothing there. An explicit `triton` still forces the kernel (a registered custom op, so the
    compiled graph does not break; Triton is then assumed installed, the op's import names it otherwise).
    `unsupported()` names why an input cannot take the kernel (a dtype, a shape), or None; such inputs run
    the reference with one warning naming the reason — never silently, never a wrong result.
    """
    if torch.compiler.is_compiling():
        # dynamo traces this once per graph and the choice is then fixed (auto and torch: the reference,
        # triton: the kernel), so it is not logged from here: logging would break the graph
        if backend != "triton":
            return "torch"
        compiled_reason = unsupported()
        if compiled_reason is None:
            return "triton"
        _warn_fallback_once_compiled(family, compiled_reason)
        return "torch"
    choice = resolve_backend(backend, device)
    if choice == "triton":
        reason = unsupported()
        if reason is not None:
            _warn_fallback_once(family, reason)
            choice = "torch"
    _log_choice_once(family, backend, choice)
    return choice


def triton_launches_on(device: torch.device) -> bool:
    """Whether a Triton kernel can launch on `device`: any GPU, or the CPU under TRITON_INTERPRET=1.

    The custom ops use it to run their PyTorch twin on a plain CPU (a compiled CPU graph that forces
    `backend="triton"`), where a launch would fail."""
    return device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1"
