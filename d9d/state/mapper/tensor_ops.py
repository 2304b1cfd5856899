"""Leaves that change tensor data: stack/unstack, concat/split, transpose, cast, and a custom function.

The layout changes are the ones HF <-> d9d conversions need: per-expert weights <-> one `[E, ...]`
tensor (stack/unstack), separate q/k/v <-> fused qkv (concat/split), `[out, in]` <-> `[in, out]`
(transpose). Each knows its inverse so a model's mapper is written once, in one direction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from d9d.state.errors import StateMappingError
from d9d.state.mapper.base import GroupFn, StateGroup, StateMapper, TableMapper, TensorMap


def _check_same(op: str, tensors: Sequence[tuple[str, torch.Tensor]], *, skip_dim: int | None) -> None:
    """Stack needs equal shapes; concat equal shapes except on `skip_dim`; both need one dtype."""
    first_key, first = tensors[0]
    for key, t in tensors[1:]:
        if t.dtype != first.dtype:
            raise StateMappingError(f"{op}: {key!r} is {t.dtype} but {first_key!r} is {first.dtype}")
        a, b = list(t.shape), list(first.shape)
        if skip_dim is not None and len(a) == len(b):
            a[skip_dim] = b[skip_dim] = 0
        if a != b:
            raise StateMappingError(
                f"{op}: {key!r} has shape {tuple(t.shape)} which does not fit "
                f"{first_key!r} {tuple(first.shape)}"
            )


class Stack(TableMapper):
    """`sources` (in order) -> one tensor stacked along a new `dim`: per-expert weights -> `[E, ...]`."""

    def __init__(self, sources: Sequence[str], target: str, dim: int = 0) -> None:
        if not sources:
            raise StateMappingError(f"Stack(-> {target!r}): needs at least one source key")
        self.sources, self.target, self.dim = tuple(sources), target, dim

        def fn(tensors: Mapping[str, torch.Tensor]) -> TensorMap:
            items = [(k, tensors[k]) for k in self.sources]
            _check_same(f"Stack(-> {target!r})", items, skip_dim=None)
            return {target: torch.stack([t for _, t in items], dim=dim)}

        super().__init__([(StateGroup.of(self.sources, [target]), fn)])

    def inverse(self) -> StateMapper:
        return Unstack(self.target, self.sources, self.dim)

    def __repr__(self) -> str:
        return f"Stack({len(self.sources)} keys -> {self.target!r}, dim={self.dim})"


class Unstack(TableMapper):
    """One tensor -> its slices along `dim` as `targets` (in order); each slice is made contiguous."""

    def __init__(self, source: str, targets: Sequence[str], dim: int = 0) -> None:
        if not targets:
            raise StateMappingError(f"Unstack({source!r}): needs at least one target key")
        self.source, self.targets, self.dim = source, tuple(targets), dim

        def fn(tensors: Mapping[str, torch.Tensor]) -> TensorMap:
            t = tensors[source]
            if t.dim() <= dim or t.shape[dim] != len(self.targets):
                raise StateMappingError(
                    f"Unstack({source!r}): shape {tuple(t.shape)} has no dim {dim} "
                    f"of size {len(self.targets)}"
                )
            return {k: s.contiguous() for k, s in zip(self.targets, t.unbind(dim), strict=True)}

        super().__init__([(StateGroup.of([source], self.targets), fn)])

    def inverse(self) -> StateMapper:
        return Stack(self.targets, self.source, self.dim)

    def __repr__(self) -> str:
        return f"Unstack({self.source!r} -> {len(self.targets)} keys, dim={self.dim})"


class Concat(TableMapper):
    """`sources` joined along an existing `dim`: q, k, v -> qkv.

    `sizes` (each source's extent on `dim`) is optional; given, it is checked and makes the mapper
    invertible into `Split`.
    """

    def __init__(
        self, sources: Sequence[str], target: str, dim: int = 0, sizes: Sequence[int] | None = None
    ) -> None:
        if not sources:
            raise StateMappingError(f"Concat(-> {target!r}): needs at least one source key")
        if sizes is not None and len(sizes) != len(sources):
            raise StateMappingError(f"Concat(-> {target!r}): {len(sizes)} sizes for {len(sources)} sources")
        self.sources, self.target, self.dim = tuple(sources), target, dim
        self.sizes = tuple(sizes) if sizes is not None else None

        def fn(tensors: Mapping[str, torch.Tensor]) -> TensorMap:
            items = [(k, tensors[k]) for k in self.sources]
            _check_same(f"Concat(-> {target!r})", items, skip_dim=dim)
            if self.sizes is not None:
                for (key, t), size in zip(items, self.sizes, strict=True):
                    if t.shape[dim] != size:
                        raise StateMappingError(
                            f"Concat(-> {target!r}): {key!r} has {t.shape[dim]} on dim {dim}, expected {size}"
                        )
            return {target: torch.cat([t for _, t in items], dim=dim)}

        super().__init__([(StateGroup.of(self.sources, [target]), fn)])

    def inverse(self) -> StateMapper:
        if self.sizes is None:
            raise StateMappingError(f"{self!r} needs sizes= to be invertible into Split")
        return Split(self.target, self.sources, self.dim, self.sizes)

    def __repr__(self) -> str:
        return f"Concat({len(self.sources)} keys -> {self.target!r}, dim={self.dim})"


class Split(TableMapper):
    """One tensor cut along `dim` into `targets`: by `sizes`, or in equal chunks when `sizes` is None."""

    def __init__(
        self, source: str, targets: Sequence[str], dim: int = 0, sizes: Sequence[int] | None = None
    ) -> None:
        if not targets:
            raise StateMappingError(f"Split({source!r}): needs at least one target key")
        if sizes is not None and len(sizes) != len(targets):
            raise StateMappingError(f"Split({source!r}): {len(sizes)} sizes for {len(targets)} targets")
        self.source, self.targets, self.dim = source, tuple(targets), dim
        self.sizes = tuple(sizes) if sizes is not None else None

        def fn(tensors: Mapping[str, torch.Tensor]) -> TensorMap:
            t = tensors[source]
            n = len(self.targets)
            extent = t.shape[dim] if t.dim() > dim else -1
            sizes = self.sizes
            if sizes is None:
                if extent < 0 or extent % n:
                    raise StateMappingError(
                        f"Split({source!r}): shape {tuple(t.shape)} does not split into {n} equal parts "
                        f"on dim {dim}"
                    )
                sizes = (extent // n,) * n
            if extent != sum(sizes):
                raise StateMappingError(
                    f"Split({source!r}): shape {tuple(t.shape)} has {extent} on dim {dim}, "
                    f"sizes sum to {sum(sizes)}"
                )
            parts = torch.split(t, list(sizes), dim=dim)
            return {k: p.contiguous() for k, p in zip(self.targets, parts, strict=True)}

        super().__init__([(StateGroup.of([source], self.targets), fn)])

    def inverse(self) -> StateMapper:
        return Concat(self.targets, self.source, self.dim, self.sizes)

    def __repr__(self) -> str:
        return f"Split({self.source!r} -> {len(self.targets)} keys, dim={self.dim})"


class Transpose(TableMapper):
    """Swap `dim0` and `dim1` of every key (result made contiguous so it serializes as laid out)."""

    def __init__(self, keys: Iterable[str], dim0: int = -2, dim1: int = -1) -> None:
        self.keys, self.dim0, self.dim1 = tuple(sorted(keys)), dim0, dim1

        def make(key: str) -> GroupFn:
            def fn(tensors: Mapping[str, torch.Tensor]) -> TensorMap:
                t = tensors[key]
                if t.dim() < 2:
                    raise StateMappingError(f"Transpose: {key!r} has shape {tuple(t.shape)}, needs >= 2 dims")
                return {key: t.transpose(dim0, dim1).contiguous()}

            return fn

        super().__init__((StateGroup.of([k], [k]), make(k)) for k in self.keys)

    def inverse(self) -> StateMapper:
        return self

    def __repr__(self) -> str:
        return f"Transpose({len(self.keys)} keys, {self.dim0}<->{self.dim1})"


class Cast(TableMapper):
    """Convert every key to `dtype` (e.g. fp32 master weights -> bf16 export)."""

    def __init__(self, keys: Iterable[str], dtype: torch.dtype) -> None:
        self.keys, self.dtype = tuple(sorted(keys)), dtype

        def make(key: str) -> GroupFn:
            def fn(tensors: Mapping[str, torch.Tensor]) -> TensorMap:
                return {key: tensors[key].to(dtype)}

            return fn

        super().__init__((StateGroup.of([k], [k]), make(k)) for k in self.keys)

    def __repr__(self) -> str:
        return f"Cast({len(self.keys)} keys -> {self.dtype})"


class Function(TableMapper):
    """Escape hatch: one group computing `targets` from `sources` with any function.

    `fn` receives `{source: tensor}` and returns `{target: tensor}`; `inverse_fn` (optional) maps back.
    """

    def __init__(
        self,
        sources: Iterable[str],
        targets: Iterable[str],
        fn: Callable[[Mapping[str, torch.Tensor]], TensorMap],
        inverse_fn: Callable[[Mapping[str, torch.Tensor]], TensorMap] | None = None,
        name: str = "Function",
    ) -> None:
        self.sources, self.targets = tuple(sources), tuple(targets)
        self.fn, self.inverse_fn, self.name = fn, inverse_fn, name
        super().__init__([(StateGroup.of(self.sources, self.targets), fn)])

    def inverse(self) -> StateMapper:
        if self.inverse_fn is None:
            raise StateMappingError(f"{self!r} was built without inverse_fn")
        return Function(self.targets, self.sources, self.inverse_fn, self.fn, f"inverse({self.name})")

    def __repr__(self) -> str:
        return f"{self.name}({list(self.sources)} -> {list(self.targets)})"
