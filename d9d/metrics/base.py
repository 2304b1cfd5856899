"""`Metric`: the identity every accumulating statistic shares.

A metric is a handful of state tensors plus two functions: `update` folds a batch into the states and
`compute` turns the states into a value. Because states declare how ranks combine them (see
`MetricState`), the base class provides syncing, checkpointing, device moves and resets once for all
metrics; a subclass writes only `__init__` (declaring states), `update` and `compute`.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any, Generic, Self, TypeVar

import torch
import torch.distributed as dist

from d9d.metrics.state import REDUCTIONS, MetricState, Reduction
from d9d.metrics.sync import sync_states

T_co = TypeVar("T_co", covariant=True)


class Metric(ABC, Generic[T_co]):
    """Accumulates statistics over many updates and, after `sync`, over many ranks.

    `sync(group)` replaces the local states by their combination over `group`: afterwards every rank
    holds the global state, so either `compute()` and `reset()`, or keep syncing snapshots (`clone()`,
    which is what `AsyncMetricCollector` does) and leave the live metric local. Syncing the same live
    metric twice without a reset would count the first sync's data twice.
    """

    def __init__(self) -> None:
        self._states: dict[str, MetricState] = {}
        self._device = torch.device("cpu")

    # -- what a subclass writes ----------------------------------------------------------------------

    def add_state(self, name: str, default: torch.Tensor, reduction: Reduction) -> MetricState:
        """Declare a state tensor; call from `__init__`. Returns the holder to read and write `.value`."""
        if not name or "." in name:
            raise ValueError(f"state name {name!r} must be non-empty and contain no '.'")
        if name in self._states:
            raise ValueError(f"{type(self).__name__} already has a state named {name!r}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"state {name!r}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if default.dtype == torch.bool or default.is_complex():
            raise ValueError(f"state {name!r}: dtype {default.dtype} cannot be reduced; use an integer dtype")
        if reduction == "cat" and default.dim() == 0:
            raise ValueError(f"state {name!r}: a 'cat' state needs at least one dim to concatenate along")
        default = default.detach().clone().to(self._device)
        state = MetricState(name=name, value=default.clone(), default=default, reduction=reduction)
        self._states[name] = state
        return state

    @abstractmethod
    def update(self, *args: Any, **kwargs: Any) -> None:
        """Fold one batch of inputs into the states."""

    @abstractmethod
    def compute(self) -> T_co:
        """The metric's value from the current states (local, or global after `sync`)."""

    # -- provided for every metric ------------------------------------------------------------------

    def named_states(self) -> Iterator[tuple[str, MetricState]]:
        """Every state with its qualified name, in a fixed order (the order collectives run in)."""
        yield from self._states.items()

    @property
    def device(self) -> torch.device:
        """Where the states live (the first state's device; the `to` target for a metric without any)."""
        for _, state in self.named_states():
            return state.value.device
        return self._device

    def to(self, device: torch.device | str) -> Self:
        self._device = torch.device(device)
        for state in self._states.values():
            state.to(self._device)
        return self

    def reset(self) -> None:
        for _, state in self.named_states():
            state.reset()

    def sync(self, group: dist.ProcessGroup | None = None) -> None:
        """Collective over `group`: combine every state across its ranks (a no-op without distributed)."""
        sync_states([state for _, state in self.named_states()], group)

    def clone(self) -> Self:
        """An independent copy with the same states, e.g. a snapshot to sync while updates go on."""
        return copy.deepcopy(self)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's local states (copies), keyed by qualified name, for resuming mid-stream."""
        return {name: state.value.detach().clone() for name, state in self.named_states()}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Restore states saved by `state_dict`; keys and (non-"cat") shapes must match exactly."""
        states = dict(self.named_states())
        missing = sorted(set(states) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(states))
        if missing or unexpected:
            raise KeyError(
                f"{type(self).__name__}.load_state_dict: missing {missing}, unexpected {unexpected}"
            )
        for name, state in states.items():
            value = state_dict[name]
            if state.reduction != "cat" and value.shape != state.default.shape:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: state {name!r} has shape {tuple(value.shape)}, "
                    f"expected {tuple(state.default.shape)}"
                )
            if state.reduction == "cat" and value.shape[1:] != state.default.shape[1:]:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: 'cat' state {name!r} has shape "
                    f"{tuple(value.shape)}, expected (*, {', '.join(map(str, state.default.shape[1:]))})"
                )
            state.value = value.detach().to(device=state.default.device, dtype=state.default.dtype).clone()
