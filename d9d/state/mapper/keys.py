"""Leaves that move tensors between keys without touching data: identity, rename, duplicate, drop."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from d9d.state.errors import StateMappingError
from d9d.state.mapper.base import GroupFn, StateGroup, StateMapper, TableMapper, TensorMap


def _move(src: str, dst: str) -> GroupFn:
    def fn(tensors: Mapping[str, torch.Tensor]) -> TensorMap:
        return {dst: tensors[src]}

    return fn


class Rename(TableMapper):
    """`{source_key: target_key}`; one group per key so each tensor streams on its own."""

    def __init__(self, mapping: Mapping[str, str]) -> None:
        self.mapping = dict(mapping)
        super().__init__((StateGroup.of([s], [t]), _move(s, t)) for s, t in self.mapping.items())

    def inverse(self) -> StateMapper:
        return Rename({t: s for s, t in self.mapping.items()})

    def __repr__(self) -> str:
        return f"Rename({len(self.mapping)} keys)"


class Identity(Rename):
    """Pass `keys` through unchanged: the mapper for a checkpoint that already matches the model."""

    def __init__(self, keys: Iterable[str]) -> None:
        super().__init__({k: k for k in keys})

    def inverse(self) -> StateMapper:
        return self

    def __repr__(self) -> str:
        return f"Identity({len(self.mapping)} keys)"


class Duplicate(TableMapper):
    """One source tensor feeds several targets (tied weights); the targets share storage."""

    def __init__(self, source: str, targets: Sequence[str]) -> None:
        if not targets:
            raise StateMappingError(f"Duplicate({source!r}): needs at least one target key")
        self.source = source
        self.targets = tuple(targets)

        def fn(tensors: Mapping[str, torch.Tensor]) -> TensorMap:
            return dict.fromkeys(self.targets, tensors[source])

        super().__init__([(StateGroup.of([source], self.targets), fn)])

    def __repr__(self) -> str:
        return f"Duplicate({self.source!r} -> {list(self.targets)})"


class Drop(TableMapper):
    """Consume `keys` and produce nothing (e.g. HF's rotary `inv_freq` buffers a model recomputes)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = tuple(sorted(keys))

        def nothing(tensors: Mapping[str, torch.Tensor]) -> TensorMap:
            return {}

        super().__init__((StateGroup.of([k], []), nothing) for k in self.keys)

    def __repr__(self) -> str:
        return f"Drop({len(self.keys)} keys)"


def strip_prefix(prefix: str, keys: Iterable[str]) -> Rename:
    """`prefix + k -> k` for every key; a key without the prefix is an error naming it."""
    keys = list(keys)
    bad = [k for k in keys if not k.startswith(prefix)]
    if bad:
        raise StateMappingError(f"strip_prefix({prefix!r}): keys without the prefix: {bad[:5]}")
    return Rename({k: k[len(prefix) :] for k in keys})


def add_prefix(prefix: str, keys: Iterable[str]) -> Rename:
    """`k -> prefix + k` for every key (the inverse of `strip_prefix`)."""
    return Rename({k: prefix + k for k in keys})


def select_prefix(prefix: str, keys: Iterable[str], *, strip: bool = False) -> Rename:
    """Keep only the keys under `prefix` (e.g. one pipeline stage's layers), optionally stripping it."""
    chosen = [k for k in keys if k.startswith(prefix)]
    return strip_prefix(prefix, chosen) if strip else Identity(chosen)
