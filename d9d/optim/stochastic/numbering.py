"""How a (possibly sharded) parameter numbers its elements for the rounding stream.

Replicas of a parameter must round identically or they drift apart; shards must not reuse each other's
bits. Numbering elements by their position in the full tensor gives both at once, and makes the rounding
independent of the sharding layout. That works whenever the local shard is one contiguous range of the
full tensor (any dim-0 sharding, i.e. FSDP); other layouts number locally and add a shard id derived from
the mesh coordinates of the sharded mesh dims only, so replicas still agree.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.distributed.tensor import DTensor

# Public in practice (DCP relies on it) but not exported; present with this signature since torch 2.5.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def _is_contiguous_block(local_shape: Sequence[int], global_shape: Sequence[int]) -> bool:
    """Whether a block of the full tensor is one contiguous run of its row-major order."""
    split = len(global_shape) - 1
    while split > 0 and local_shape[split] == global_shape[split]:
        split -= 1
    return all(local_shape[d] == 1 for d in range(split))


def element_numbering(param: Tensor) -> tuple[int, int]:
    """`(first_index, shard)` of this rank's local elements (see `RoundingStream`)."""
    if not isinstance(param, DTensor):
        return 0, 0
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return 0, 0
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
    global_shape = tuple(param.shape)
    if _is_contiguous_block(local_shape, global_shape):
        first_index, stride = 0, 1
        for dim in reversed(range(len(global_shape))):
            first_index += offset[dim] * stride
            stride *= global_shape[dim]
        return first_index, 0
    shard = 0
    for dim, placement in enumerate(param.placements):
        if placement.is_shard():
            shard = shard * mesh.size(dim) + coordinate[dim]
    return 0, shard + 1
