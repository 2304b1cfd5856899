"""Mesh domains: named views of the one physical rank grid.

A domain is a permutation + reshape of the physical grid (see `PHYSICAL_DIMS`), so the same rank sits
at consistent coordinates in every domain. Computing the layouts is pure tensor arithmetic and is kept
apart from process-group creation so it can be tested without any process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from d9d.core.mesh_params import PHYSICAL_DIMS, DeviceMeshParameters


class MeshDomain(StrEnum):
    """Why several domains: each parallel strategy wants the ranks grouped differently.

    - REGULAR: every physical dim visible (context parallel fused) — the general-purpose view.
    - DENSE: what FSDP/HSDP of dense weights needs: one replicate dim and one shard dim (dp_shard fused with
      cp_shard, because context-parallel ranks hold identical weights and can share the sharding).
    - EXPERT: experts sharded over `ep_shard`, replicated over `ep_replicate`.
    - BATCH: how the batch is split: dp ranks get different samples, cp ranks different sequence chunks.
    - FLAT: all ranks in one dim, for world-wide collectives.
    """

    REGULAR = "regular"
    DENSE = "dense"
    EXPERT = "expert"
    BATCH = "batch"
    FLAT = "flat"


@dataclass(frozen=True)
class DomainLayout:
    """Rank grid of one domain: `ranks[i0, i1, ...]` is the global rank at those coordinates."""

    dim_names: tuple[str, ...]
    ranks: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.ranks.shape)

    def coordinates(self, rank: int) -> dict[str, int]:
        where = (self.ranks == rank).nonzero()
        if where.shape[0] != 1:
            raise ValueError(f"rank {rank} is not in this layout of {self.ranks.numel()} ranks")
        return {name: int(idx) for name, idx in zip(self.dim_names, where[0].tolist(), strict=True)}


def _physical_grid(params: DeviceMeshParameters) -> torch.Tensor:
    return torch.arange(params.world_size, dtype=torch.int64).reshape(params.physical_sizes)


def compute_layout(params: DeviceMeshParameters, domain: MeshDomain) -> DomainLayout:
    grid = _physical_grid(params)
    pp, dpr, dps, cpr, cps, tp = params.physical_sizes
    assert len(PHYSICAL_DIMS) == grid.dim()
    if domain is MeshDomain.REGULAR:
        return DomainLayout(
            ("pp", "dp_replicate", "dp_shard", "cp", "tp"), grid.reshape(pp, dpr, dps, cpr * cps, tp)
        )
    if domain is MeshDomain.DENSE:
        # (pp, dpr, dps, cpr, cps, tp) -> (pp, dpr, cpr, dps, cps, tp) -> merge replicate and shard pairs.
        permuted = grid.permute(0, 1, 3, 2, 4, 5).contiguous()
        return DomainLayout(
            ("pp", "dp_cp_replicate", "dp_cp_shard", "tp"), permuted.reshape(pp, dpr * cpr, dps * cps, tp)
        )
    if domain is MeshDomain.EXPERT:
        ep = params.expert_parallel
        return DomainLayout(("pp", "ep_replicate", "ep_shard"), grid.reshape(pp, params.expert_replicate, ep))
    if domain is MeshDomain.BATCH:
        return DomainLayout(("pp", "dp", "cp", "tp"), grid.reshape(pp, dpr * dps, cpr * cps, tp))
    if domain is MeshDomain.FLAT:
        return DomainLayout(("world",), grid.reshape(-1))
    raise ValueError(f"unknown mesh domain {domain!r}")
