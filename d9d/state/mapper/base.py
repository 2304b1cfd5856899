"""The mapper contract: dependency groups declared up front, applied one group at a time.

A mapper turns a *source* state (keys -> tensors) into a *target* state. It never sees the whole state:
it declares `groups()`, each naming the source keys it consumes and the target keys it produces, and
`apply` runs one group on exactly its input tensors. Because the groups are known before any tensor is
read, a reader can load keys in file order and fire a group the moment its inputs are present, then drop
them: peak memory is one group plus one file's keys, never the checkpoint.

Rules every mapper obeys (checked by `check_groups`):
- a source key is consumed by at most one group (fan-out is explicit, see `Duplicate`);
- a target key is produced by exactly one group;
- `groups()` order is deterministic, so ranks that run collectives inside `apply` (DTensor gathers)
  stay in lock-step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from d9d.state.errors import StateMappingError

TensorMap = dict[str, torch.Tensor]
GroupFn = Callable[[Mapping[str, torch.Tensor]], TensorMap]


@dataclass(frozen=True)
class StateGroup:
    """One unit of work: `inputs` (source keys) are all needed before `outputs` (target keys) exist.

    A group may have no inputs (it creates tensors) or no outputs (it drops keys), not neither.
    """

    inputs: frozenset[str]
    outputs: frozenset[str]

    def __post_init__(self) -> None:
        if not self.inputs and not self.outputs:
            raise StateMappingError("a state group needs at least one input or output key")

    @classmethod
    def of(cls, inputs: Iterable[str], outputs: Iterable[str]) -> StateGroup:
        return cls(frozenset(inputs), frozenset(outputs))

    def sort_key(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(sorted(self.outputs)), tuple(sorted(self.inputs))

    def __repr__(self) -> str:
        return f"StateGroup({_fmt_keys(self.inputs)} -> {_fmt_keys(self.outputs)})"


class StateMapper(ABC):
    """Identity of a state transform; subclasses are leaves (one op) or compositions of mappers."""

    @abstractmethod
    def groups(self) -> Sequence[StateGroup]:
        """Dependency groups in a deterministic order; touches no tensor data."""

    @abstractmethod
    def apply(self, group: StateGroup, tensors: Mapping[str, torch.Tensor]) -> TensorMap:
        """Run one group: `tensors` holds exactly `group.inputs`; returns exactly `group.outputs`."""

    def inverse(self) -> StateMapper:
        """The mapper that undoes this one (e.g. d9d -> HF from HF -> d9d), where it is well defined."""
        raise StateMappingError(f"{self!r} has no inverse")

    def inputs(self) -> frozenset[str]:
        return frozenset().union(*(g.inputs for g in self.groups()))

    def outputs(self) -> frozenset[str]:
        return frozenset().union(*(g.outputs for g in self.groups()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.groups())} groups)"


def check_groups(owner: str, groups: Sequence[StateGroup]) -> None:
    """Refuse a key consumed by two groups or produced by two groups, naming both."""
    consumer: dict[str, StateGroup] = {}
    producer: dict[str, StateGroup] = {}
    for group in groups:
        for key in group.inputs:
            if key in consumer:
                raise StateMappingError(
                    f"{owner}: source key {key!r} is consumed by two groups, {consumer[key]!r} "
                    f"and {group!r}; "
                    "use Duplicate to feed one tensor to several targets"
                )
            consumer[key] = group
        for key in group.outputs:
            if key in producer:
                raise StateMappingError(
                    f"{owner}: target key {key!r} is produced by two groups, {producer[key]!r} and {group!r}"
                )
            producer[key] = group


def apply_group(mapper: StateMapper, group: StateGroup, tensors: Mapping[str, torch.Tensor]) -> TensorMap:
    """`mapper.apply` with the contract checked on both sides, so a bug names the mapper and the keys."""
    given = tensors.keys()
    if given != group.inputs:
        missing = sorted(group.inputs - given)
        extra = sorted(given - group.inputs)
        raise StateMappingError(
            f"{mapper!r}: group {group!r} got the wrong inputs (missing {missing}, unexpected {extra})"
        )
    out = mapper.apply(group, tensors)
    if out.keys() != group.outputs:
        missing = sorted(group.outputs - out.keys())
        extra = sorted(out.keys() - group.outputs)
        raise StateMappingError(
            f"{mapper!r}: group {group!r} returned the wrong outputs (missing {missing}, unexpected {extra})"
        )
    return out


class TableMapper(StateMapper):
    """A mapper given as a table of groups and the function computing each; the base of the leaves."""

    def __init__(self, table: Iterable[tuple[StateGroup, GroupFn]]) -> None:
        entries = sorted(table, key=lambda item: item[0].sort_key())
        self._groups = tuple(group for group, _ in entries)
        check_groups(type(self).__name__, self._groups)
        self._fns = dict(entries)

    def groups(self) -> Sequence[StateGroup]:
        return self._groups

    def apply(self, group: StateGroup, tensors: Mapping[str, torch.Tensor]) -> TensorMap:
        fn = self._fns.get(group)
        if fn is None:
            raise StateMappingError(f"{self!r} has no group {group!r}")
        return fn(tensors)


def _fmt_keys(keys: Iterable[str], limit: int = 4) -> str:
    ordered = sorted(keys)
    shown = ", ".join(repr(k) for k in ordered[:limit])
    more = f", ... (+{len(ordered) - limit})" if len(ordered) > limit else ""
    return "{" + shown + more + "}"
