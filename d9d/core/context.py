"""`DistributedContext`: the single source of topology truth for a rank.

It owns nothing of the training loop. It knows which rank this is, which device it drives, and the
DeviceMesh of every domain, so that parallelization strategies, data sharding, checkpointing and logging
all agree on the same layout.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import Store

from d9d.core import flight_recorder
from d9d.core.domains import DomainLayout, MeshDomain, compute_layout
from d9d.core.logging import RankLoggerAdapter, build_rank_logger
from d9d.core.mesh_params import DeviceMeshParameters

BackendChoice = Literal["auto", "nccl", "gloo"]


def resolve_backend(choice: BackendChoice) -> Literal["nccl", "gloo"]:
    """`auto` means NCCL when this process can see a GPU, gloo otherwise."""
    if choice == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if choice == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend='nccl' was requested but no CUDA device is visible to this process")
    return choice


def init_process_group(
    backend: Literal["nccl", "gloo"],
    *,
    device: torch.device | None = None,
    store: Store | None = None,
    rank: int = -1,
    world_size: int = -1,
    timeout: datetime.timedelta | None = None,
) -> None:
    """Create the default process group: gloo, or NCCL with gloo alongside for the CPU-side object
    collectives (metrics, manifests) on `device`.

    Without `store`, torch reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment, as
    torchrun sets them; with it, `rank` and `world_size` say who this process is.

    The collective flight recorder is kept on (`d9d.core.flight_recorder`): torch reads its size when the
    first group is created, and a hang report reads each rank's last collectives from it.
    """
    flight_recorder.enable()
    kwargs: dict[str, Any] = {}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    if timeout is not None:
        kwargs["timeout"] = timeout
    if backend == "nccl":
        if device is None:
            raise ValueError("init_process_group: backend 'nccl' needs the rank's CUDA device")
        torch.cuda.set_device(device)
        dist.init_process_group(backend="cuda:nccl,cpu:gloo", device_id=device, **kwargs)
    else:
        dist.init_process_group(backend="gloo", **kwargs)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


@dataclass
class DistributedContext:
    """Topology of one rank. Build with `create` (initializes the process group) or `local`."""

    params: DeviceMeshParameters
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: Literal["nccl", "gloo"] | None
    _meshes: dict[MeshDomain, DeviceMesh] = field(default_factory=dict, repr=False)
    _layouts: dict[MeshDomain, DomainLayout] = field(default_factory=dict, repr=False)
    _logger: RankLoggerAdapter | None = field(default=None, repr=False)

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        params: DeviceMeshParameters,
        *,
        backend: BackendChoice = "auto",
        timeout: datetime.timedelta | None = None,
        device_index: int | None = None,
    ) -> DistributedContext:
        """Join (or reuse) the default process group and build every domain's DeviceMesh.

        Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT as torchrun sets them when the
        process group is not initialized yet. Must be called by every rank, in the same order.
        """
        resolved = resolve_backend(backend)
        device = _select_device(resolved, device_index)
        if not dist.is_initialized():
            init_process_group(resolved, device=device, timeout=timeout)
        existing = str(dist.get_backend())
        if resolved == "nccl" and "nccl" not in existing:
            raise RuntimeError(
                f"backend='nccl' was requested but the default process group was initialized with "
                f"{existing!r}; initialize it with NCCL (e.g. 'cuda:nccl,cpu:gloo' and device_id) or ask for "
                "backend='gloo'"
            )
        world_size = dist.get_world_size()
        params.check_world_size(world_size)
        ctx = cls(
            params=params,
            rank=dist.get_rank(),
            world_size=world_size,
            local_rank=_local_rank(),
            device=device,
            backend=resolved,
        )
        ctx._build_meshes()
        return ctx

    @classmethod
    def local(cls, device: torch.device | str | None = None) -> DistributedContext:
        """Single-process mode with no process group: for debugging and unit tests.

        Domains have layouts (all of size 1) but no DeviceMesh; `mesh_for` raises. Use `create` with a
        world of one rank when code needs meshes (e.g. DTensor parameters).
        """
        dev = torch.device(device) if device is not None else torch.device("cpu")
        return cls(
            params=DeviceMeshParameters(),
            rank=0,
            world_size=1,
            local_rank=0,
            device=dev,
            backend=None,
        )

    def _build_meshes(self) -> None:
        for domain in MeshDomain:
            layout = compute_layout(self.params, domain)
            self._layouts[domain] = layout
            self._meshes[domain] = _cached_mesh(self.device.type, layout)

    # -- topology queries ---------------------------------------------------------------------------

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0

    def layout(self, domain: MeshDomain | str) -> DomainLayout:
        dom = MeshDomain(domain)
        if dom not in self._layouts:
            self._layouts[dom] = compute_layout(self.params, dom)
        return self._layouts[dom]

    def mesh_for(self, domain: MeshDomain | str) -> DeviceMesh:
        dom = MeshDomain(domain)
        if dom not in self._meshes:
            raise RuntimeError(
                f"no DeviceMesh for domain {dom.value!r}: this context is single-process without a process "
                "group; build it with DistributedContext.create(...)"
            )
        return self._meshes[dom]

    def coordinates(self, domain: MeshDomain | str = MeshDomain.REGULAR) -> dict[str, int]:
        """This rank's index along each dim of `domain`."""
        return self.layout(domain).coordinates(self.rank)

    @property
    def logger(self) -> RankLoggerAdapter:
        if self._logger is None:
            self._logger = build_rank_logger(self.rank, self.coordinates(MeshDomain.REGULAR))
        return self._logger

    # -- synchronization helpers --------------------------------------------------------------------

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self, *, local: bool = False) -> Iterator[None]:
        """Let the (local) main process do a thing first, e.g. build a dataset cache, then the rest.

        Every rank passes exactly two barriers, so ranks never deadlock whichever branch they take.
        """
        leader = self.is_local_main_process if local else self.is_main_process
        if not leader:
            self.barrier()
        try:
            yield
        finally:
            if leader:
                self.barrier()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Change the collective timeout of every process group this context uses.

        The engine uses a long timeout during setup and the first step (compilation, checkpoint loading)
        and a short one afterwards so a hung rank is detected quickly.
        """
        if not self.is_distributed:
            return
        from torch.distributed.distributed_c10d import _set_pg_timeout

        groups: list[dist.ProcessGroup] = [dist.group.WORLD]  # type: ignore[list-item]
        for mesh in self._meshes.values():
            groups.extend(mesh.get_all_groups())
        seen: set[int] = set()
        for group in groups:
            if id(group) in seen:
                continue
            seen.add(id(group))
            _set_pg_timeout(timeout, group)


# Building a DeviceMesh creates process groups (collective, and NCCL communicators on GPU). Contexts with the
# same layout on the same default group share meshes instead of creating new communicators each time; every
# rank builds contexts in the same order, so the cache is consistent across ranks.
_MESH_CACHE: dict[tuple[object, ...], DeviceMesh] = {}


def _cached_mesh(device_type: str, layout: DomainLayout) -> DeviceMesh:
    key = (
        id(dist.group.WORLD),
        device_type,
        layout.dim_names,
        layout.shape,
        tuple(layout.ranks.flatten().tolist()),
    )
    mesh = _MESH_CACHE.get(key)
    if mesh is None:
        mesh = DeviceMesh(device_type, layout.ranks, mesh_dim_names=layout.dim_names)
        _MESH_CACHE[key] = mesh
    return mesh


def _select_device(backend: Literal["nccl", "gloo"], device_index: int | None) -> torch.device:
    if backend == "nccl":
        count = torch.cuda.device_count()
        index = device_index if device_index is not None else _local_rank() % count
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
