"""Per-layer activation checkpointing that lets layers tell a recomputation from a real forward.

Two kinds, both around one decoder layer:

- whole-layer (`checkpointed(fn, ...)`): only the layer's inputs are kept; backward replays its forward.
- op-level selective (`checkpointed(fn, ..., policy=SaveOps(...))`): the outputs of the expensive ops the
  policy names (matmuls, attention kernels) are kept as well, everything else (norms, activations, rotary,
  casts) is recomputed from them in backward (`torch.utils.checkpoint.create_selective_checkpoint_contexts`).

Inside a compiled region the checkpoint must be traced with the layer, so the compiler applies the policy to
the joint graph (`traced_checkpoint`); a region that does this says so with `applies_checkpoint_policy`, and
the layer's owner hands it the policy for one call with `delegate_policy` instead of wrapping the call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any, Literal, Protocol

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_state = threading.local()

OpKind = Literal["matmul", "attention"]
"""What op-level selective checkpointing may keep: `matmul` (dense, batched and grouped matrix products:
projections, MLPs, experts, the router), `attention` (the attention kernels' outputs)."""

OP_KINDS: tuple[OpKind, ...] = ("matmul", "attention")

# Operator names (`OpOverload.name()` / a higher-order op's name) by kind. Names rather than op objects: some
# exist only in some torch builds or with an optional package (flash_attn) installed.
_OPS: dict[OpKind, frozenset[str]] = {
    "matmul": frozenset(
        {
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::baddbmm",
            "aten::_grouped_mm",
            "aten::_scaled_mm",
            "aten::_scaled_grouped_mm",
        }
    ),
    "attention": frozenset(
        {
            "aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_efficient_attention",
            "aten::_scaled_dot_product_cudnn_attention",
            "aten::_flash_attention_forward",
            "aten::_efficient_attention_forward",
            "flash_attn::_flash_attn_forward",
            "flash_attn::_flash_attn_varlen_forward",
            "flex_attention",
        }
    ),
}

# Collectives inside a layer (tensor / sequence parallelism, expert all-to-all) are always kept: recomputing
# one costs the same communication again in backward and saves no compute.
_COMMUNICATION_NAMESPACE = "_c10d_functional::"


def is_recomputing() -> bool:
    """True while a checkpointed layer re-runs its forward during backward.

    Layers with side effects (MoE load statistics, expert-bias load accumulation) skip them then, so a
    checkpointed layer counts its tokens once, like an uncheckpointed one.
    """
    return bool(getattr(_state, "recomputing", False))


class _Recomputing:
    """The recompute context of one checkpointed call: flags the replay (and enters `inner`, torch's cached
    selective mode, when given). A class, not a generator: a backward split into input and weight passes
    (zero-bubble schedules) replays the same checkpoint twice, entering its context again."""

    def __init__(self, inner: contextlib.AbstractContextManager[Any] | None = None) -> None:
        self.inner = inner
        self.previous: list[bool] = []

    def __enter__(self) -> None:
        self.previous.append(is_recomputing())
        _state.recomputing = True
        if self.inner is not None:
            self.inner.__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if self.inner is not None:
                self.inner.__exit__(kind, error, traceback)
        finally:
            _state.recomputing = self.previous.pop()


def _contexts() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    return contextlib.nullcontext(), _Recomputing()


@dataclass(frozen=True)
class SaveOps:
    """An op-level checkpoint policy: keep the outputs of ops of these kinds (and of collectives), recompute
    the rest. Frozen and hashable, so each distinct policy maps to one traced context function."""

    kinds: frozenset[OpKind]

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kinds) - set(OP_KINDS))
        if unknown or not self.kinds:
            raise ValueError(
                f"op kinds must be a non-empty subset of {list(OP_KINDS)}, got {sorted(self.kinds)}"
            )

    def saves(self, name: str) -> bool:
        return name.startswith(_COMMUNICATION_NAMESPACE) or any(name in _OPS[k] for k in self.kinds)

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = func.name() if callable(getattr(func, "name", None)) else str(func)
        return CheckpointPolicy.MUST_SAVE if self.saves(name) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts(
    policy: SaveOps,
) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """Eager: torch's caching (forward) and cached (recompute) modes, the latter also flagging the replay."""
    forward, recompute = create_selective_checkpoint_contexts(policy)
    return forward, _Recomputing(recompute)


def checkpointed(
    fn: Callable[..., torch.Tensor], *args: Any, policy: SaveOps | None = None, **kwargs: Any
) -> torch.Tensor:
    """Runs `fn(*args, **kwargs)` keeping only its inputs (with `policy`: also the outputs of the ops it
    saves); the rest of the forward is replayed in backward, with `is_recomputing()` true."""
    context_fn = _contexts if policy is None else partial(_selective_contexts, policy)
    out: torch.Tensor = checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    return out


_TRACED_CONTEXTS: dict[SaveOps, Callable[[], Any]] = {}


def traced_context_fn(policy: SaveOps) -> Callable[[], Any]:
    """The context function for a checkpoint traced inside a compiled region: torch's own selective
    contexts only (the compiler reads the policy from them and recomputes in the compiled backward, which
    replays no Python side effects). One function object per policy, so the compiled code's guard on it holds
    from call to call."""
    known = _TRACED_CONTEXTS.get(policy)
    if known is None:

        def context_fn() -> Any:
            return create_selective_checkpoint_contexts(policy)

        known = _TRACED_CONTEXTS.setdefault(policy, context_fn)
    return known


def traced_checkpoint(
    fn: Callable[..., Any], context_fn: Callable[[], Any], *args: Any, **kwargs: Any
) -> Any:
    """`checkpoint` as written inside a compiled function (`context_fn` from `traced_context_fn`)."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


class PolicyApplyingForward(Protocol):
    """A module `forward` (a compiled region) that applies an op-level policy itself when one is delegated to
    its call (`delegate_policy`), tracing the checkpoint with the layer, for as long as
    `applies_checkpoint_policy` is true (the owner reads it before each call)."""

    @property
    def applies_checkpoint_policy(self) -> bool: ...


_DELEGATED: ContextVar[SaveOps | None] = ContextVar("d9d_delegated_checkpoint_policy", default=None)


@contextlib.contextmanager
def delegate_policy(policy: SaveOps) -> Iterator[None]:
    """Hands `policy` to the next `PolicyApplyingForward` that calls `take_delegated_policy` in this
    context (the layer's forward, after its module hooks ran)."""
    token = _DELEGATED.set(policy)
    try:
        yield
    finally:
        _DELEGATED.reset(token)


def take_delegated_policy() -> SaveOps | None:
    """The policy delegated to this call, cleared so that a nested region does not apply it again."""
    policy = _DELEGATED.get()
    if policy is not None:
        _DELEGATED.set(None)
    return policy
