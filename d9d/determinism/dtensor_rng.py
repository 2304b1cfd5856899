"""Random initialization of sharded (DTensor) parameters that does not depend on the sharding.

Goal: a model initialized with seed S gives the same full weights whether it is replicated, FSDP-sharded
or tensor-parallel — so a run can change its layout and tests can compare layouts bit for bit.

- On CUDA, DTensor's offset-based RNG already does this: every rank of the mesh seeds the same generator
  and each shard skips ahead to its own offset of the philox stream. `seed_dtensor_rng` sets it up.
- On CPU the generator has no offsets and DTensor simply runs the op on each local shard, so every shard
  draws the *same* numbers (duplicated, correlated weights). `full_tensor_random` fixes that by generating
  the full tensor on every rank (same seed → same tensor) and keeping this rank's shard. It costs one
  full-size temporary per parameter, which is fine at CPU-debugging scale.

`parameter_init_rng` combines both with the `PARAMETERS` seed rule of `seeds.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.determinism.rng_state import seed_everything

_aten = torch.ops.aten
# In-place sampling ops: torch.nn.init and most user init code end up in one of these. Intercepted at the
# dispatcher (not at torch function level), because `nn.init.*` hide the tensor method behind their own
# torch-function dispatch.
_INPLACE_RANDOM: frozenset[Any] = frozenset(
    {
        _aten.normal_,
        _aten.uniform_,
        _aten.bernoulli_,
        _aten.exponential_,
        _aten.geometric_,
        _aten.log_normal_,
        _aten.cauchy_,
        _aten.random_,
    }
)


def _mesh_has_offset_rng(mesh: DeviceMesh) -> bool:
    return mesh.device_type != "cpu"


class _FullTensorRandomMode(TorchDispatchMode):
    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if (
            func.overloadpacket not in _INPLACE_RANDOM
            or not isinstance(target, DTensor)
            or _mesh_has_offset_rng(target.device_mesh)
        ):
            return func(*args, **kwargs)
        full = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
        func(full, *args[1:], **kwargs)
        copy_full_(target, full)
        return target


def copy_full_(target: torch.Tensor, full: torch.Tensor) -> None:
    """`target` takes the values of the whole tensor `full`, which every rank holds the same: a DTensor keeps
    its shard of it, sliced out locally (no communication)."""
    full = full.to(target.device, target.dtype)
    if isinstance(target, DTensor):
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target = target.to_local()
    with torch.no_grad():
        target.copy_(full)


@contextlib.contextmanager
def full_tensor_random() -> Iterator[None]:
    """In-place random ops on CPU DTensors sample the full tensor and keep the local shard."""
    with _FullTensorRandomMode():
        yield


def seed_dtensor_rng(seed: int, mesh: DeviceMesh) -> None:
    """Seed the local generators and, on accelerator meshes, DTensor's offset-based RNG.

    Every rank of `mesh` must pass the same seed (that is the DTensor contract); pipeline stages use
    different meshes and seeds.
    """
    seed_everything(seed)
    if _mesh_has_offset_rng(mesh):
        from torch.distributed.tensor._random import manual_seed

        manual_seed(seed, mesh)


@contextlib.contextmanager
def parameter_init_rng(seed: int, mesh: DeviceMesh | None) -> Iterator[None]:
    """Scope for materializing parameters (`reset_parameters()`): same seed on the whole stage, shards
    consistent with an unsharded init. Pass `RankSeeds.parameters` and a mesh holding this rank's stage
    (None for a single process without meshes). Afterwards seed the activation RNG explicitly.
    """
    if mesh is None:
        seed_everything(seed)
    else:
        seed_dtensor_rng(seed, mesh)
    with full_tensor_random():
        yield
