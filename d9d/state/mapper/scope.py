"""Scoping a mapper: a key prefix, a worker's slice of the groups, the part one rank needs.

`Prefixed` reuses a per-layer mapper under `layers.{i}.`, `Shard` splits groups round robin across
workers, `Select` keeps what one rank loads or saves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from d9d.state.errors import StateMappingError
from d9d.state.mapper.base import StateGroup, StateMapper, TensorMap, apply_group


class Prefixed(StateMapper):
    """Run `inner` on keys under `prefix`: a per-layer mapper reused for `layers.0.`, `layers.1.`, ...

    `on` picks which side is prefixed: both (default), only the source ("input") or only the target
    ("output") — the latter two move a sub-state in or out of a scope.
    """

    def __init__(self, prefix: str, inner: StateMapper, on: str = "both") -> None:
        if on not in ("both", "input", "output"):
            raise StateMappingError(f"Prefixed: on={on!r} must be 'both', 'input' or 'output'")
        self.prefix, self.inner, self.on = prefix, inner, on
        pin = prefix if on in ("both", "input") else ""
        pout = prefix if on in ("both", "output") else ""
        self._pin, self._pout = pin, pout
        self._inner_group: dict[StateGroup, StateGroup] = {}
        for g in inner.groups():
            outer = StateGroup.of([pin + k for k in g.inputs], [pout + k for k in g.outputs])
            self._inner_group[outer] = g
        self._groups = tuple(sorted(self._inner_group, key=StateGroup.sort_key))

    def groups(self) -> Sequence[StateGroup]:
        return self._groups

    def apply(self, group: StateGroup, tensors: Mapping[str, torch.Tensor]) -> TensorMap:
        inner_group = self._inner_group.get(group)
        if inner_group is None:
            raise StateMappingError(f"{self!r} has no group {group!r}")
        n = len(self._pin)
        out = apply_group(self.inner, inner_group, {k[n:]: t for k, t in tensors.items()})
        return {self._pout + k: t for k, t in out.items()}

    def inverse(self) -> StateMapper:
        flipped = {"both": "both", "input": "output", "output": "input"}[self.on]
        return Prefixed(self.prefix, self.inner.inverse(), flipped)

    def __repr__(self) -> str:
        return f"Prefixed({self.prefix!r}, {self.inner!r}, on={self.on!r})"


class Shard(StateMapper):
    """Worker `index` of `num_shards` gets every `num_shards`-th group of `inner` (round robin over the
    deterministic group order): N processes convert one checkpoint with no key handled twice."""

    def __init__(self, inner: StateMapper, num_shards: int, index: int) -> None:
        if num_shards < 1 or not 0 <= index < num_shards:
            raise StateMappingError(f"Shard: index={index} must be in [0, num_shards={num_shards})")
        self.inner, self.num_shards, self.index = inner, num_shards, index
        self._groups = tuple(inner.groups()[index::num_shards])
        self._mine = frozenset(self._groups)

    def groups(self) -> Sequence[StateGroup]:
        return self._groups

    def apply(self, group: StateGroup, tensors: Mapping[str, torch.Tensor]) -> TensorMap:
        if group not in self._mine:
            raise StateMappingError(f"{self!r} does not own group {group!r}")
        return self.inner.apply(group, tensors)

    def __repr__(self) -> str:
        return f"Shard({self.index}/{self.num_shards} of {self.inner!r})"


class Select(StateMapper):
    """The part of `inner` one rank needs: by target keys (loading) or by source keys (saving).

    - `outputs=keys`: groups producing any of `keys`; other outputs of those groups are computed and
      dropped (a rank holding only q still reads the fused qkv it is cut from).
    - `inputs=keys`: groups whose inputs are all in `keys` (a pipeline stage saves its own layers); a
      group needing keys both here and elsewhere is an error naming them.
    """

    def __init__(
        self,
        inner: StateMapper,
        *,
        outputs: Iterable[str] | None = None,
        inputs: Iterable[str] | None = None,
    ) -> None:
        if (outputs is None) == (inputs is None):
            raise StateMappingError("Select: give exactly one of outputs= or inputs=")
        self.inner = inner
        self._inner_group: dict[StateGroup, StateGroup] = {}
        if outputs is not None:
            wanted = frozenset(outputs)
            for g in inner.groups():
                if g.outputs & wanted:
                    self._inner_group[StateGroup(g.inputs, g.outputs & wanted)] = g
        else:
            here = frozenset(inputs or ())
            for g in inner.groups():
                if g.inputs and g.inputs <= here:
                    self._inner_group[g] = g
                elif g.inputs & here:
                    raise StateMappingError(
                        f"Select: group {g!r} needs {sorted(g.inputs & here)[:3]} (here) and "
                        f"{sorted(g.inputs - here)[:3]} (not here); it cannot run on one side"
                    )
        self._groups = tuple(sorted(self._inner_group, key=StateGroup.sort_key))

    def groups(self) -> Sequence[StateGroup]:
        return self._groups

    def apply(self, group: StateGroup, tensors: Mapping[str, torch.Tensor]) -> TensorMap:
        inner_group = self._inner_group.get(group)
        if inner_group is None:
            raise StateMappingError(f"{self!r} has no group {group!r}")
        out = apply_group(self.inner, inner_group, tensors)
        return {k: t for k, t in out.items() if k in group.outputs}

    def __repr__(self) -> str:
        return f"Select({len(self._groups)} of {self.inner!r})"
