"""Leaves between full tensors and DTensors: distribute on load, gather on save.

`Distribute` shards a full tensor without communication: every rank read the same bytes from the
checkpoint, so each keeps its own slice. For plain `Shard`/`Replicate` placements the slice is cut
on the host before it moves to the mesh's device: a rank touches (and, with the reader's mapped
tensors, reads) only its own pages, and a GPU never holds the full tensor.

`Gather` is a collective: every rank of the tensor's mesh must apply the same groups in the same
order, which the deterministic group order of every mapper guarantees when ranks build the same
mapper.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from d9d.state.errors import StateMappingError
from d9d.state.mapper.base import GroupFn, StateGroup, StateMapper, TableMapper, TensorMap


@dataclass(frozen=True)
class ShardingSpec:
    """Where a key lives: its mesh and one placement per mesh dim."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    @classmethod
    def of(cls, tensor: DTensor) -> ShardingSpec:
        return cls(tensor.device_mesh, tuple(tensor.placements))


class Distribute(TableMapper):
    """Full tensor -> this rank's DTensor shard, per key: `{key: ShardingSpec(mesh, placements)}`."""

    def __init__(self, specs: Mapping[str, ShardingSpec]) -> None:
        self.specs = dict(specs)
        for key, spec in self.specs.items():
            if len(spec.placements) != spec.mesh.ndim:
                raise StateMappingError(
                    f"Distribute: {key!r} has {len(spec.placements)} placements "
                    f"for a {spec.mesh.ndim}-dim mesh"
                )
            if any(isinstance(p, Partial) for p in spec.placements):
                raise StateMappingError(
                    f"Distribute: {key!r} has a Partial placement; a checkpoint holds full values"
                )

        def make(key: str, spec: ShardingSpec) -> GroupFn:
            def fn(tensors: Mapping[str, torch.Tensor]) -> TensorMap:
                t = tensors[key]
                if isinstance(t, DTensor):
                    raise StateMappingError(f"Distribute: {key!r} is already a DTensor")
                return {key: _distribute(t, spec)}

            return fn

        super().__init__((StateGroup.of([k], [k]), make(k, s)) for k, s in self.specs.items())

    def inverse(self) -> StateMapper:
        return Gather(self.specs)

    def __repr__(self) -> str:
        return f"Distribute({len(self.specs)} keys)"


def _distribute(tensor: torch.Tensor, spec: ShardingSpec) -> DTensor:
    if any(type(p) not in (Shard, Replicate) for p in spec.placements):  # e.g. strided shards
        return distribute_tensor(tensor, spec.mesh, list(spec.placements), src_data_rank=None)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, spec.mesh, spec.placements)
    local = tensor
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        if size != tensor.shape[dim]:
            local = local.narrow(dim, start, size)
    local = local.to(spec.mesh.device_type).contiguous()
    stride = [1] * tensor.dim()  # the global tensor's contiguous strides
    for dim in range(tensor.dim() - 2, -1, -1):
        stride[dim] = stride[dim + 1] * tensor.shape[dim + 1]
    return DTensor.from_local(
        local, spec.mesh, list(spec.placements), run_check=False, shape=tensor.shape, stride=tuple(stride)
    )


class Gather(TableMapper):
    """DTensor -> full tensor (a collective over its mesh); plain tensors are an error naming the key."""

    def __init__(self, keys: Iterable[str] | Mapping[str, ShardingSpec]) -> None:
        self.specs: dict[str, ShardingSpec] | None = dict(keys) if isinstance(keys, Mapping) else None
        self.keys: Sequence[str] = tuple(sorted(keys))

        def make(key: str) -> GroupFn:
            def fn(tensors: Mapping[str, torch.Tensor]) -> TensorMap:
                t = tensors[key]
                if not isinstance(t, DTensor):
                    raise StateMappingError(f"Gather: {key!r} is a plain tensor, not a DTensor")
                return {key: t.full_tensor()}

            return fn

        super().__init__((StateGroup.of([k], [k]), make(k)) for k in self.keys)

    def inverse(self) -> StateMapper:
        if self.specs is None:
            raise StateMappingError(
                f"{self!r} was built from keys only; give it specs to invert into Distribute"
            )
        return Distribute(self.specs)

    def __repr__(self) -> str:
        return f"Gather({len(self.keys)} keys)"
