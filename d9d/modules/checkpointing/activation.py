"""Per-layer activation checkpointing that lets layers tell a recomputation from a real forward."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed layer re-runs its forward during backward.

    Layers with side effects (MoE load statistics, expert-bias load accumulation) skip them then, so a
    checkpointed layer counts its tokens once, like an uncheckpointed one.
    """
    return bool(getattr(_state, "recomputing", False))


@contextlib.contextmanager
def _recomputing() -> Iterator[None]:
    previous = is_recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous


def _contexts() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    return contextlib.nullcontext(), _recomputing()


def checkpointed(fn: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """Runs `fn(*args, **kwargs)` keeping only its inputs; the forward is replayed in backward."""
    out: torch.Tensor = checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts, **kwargs)
    return out
