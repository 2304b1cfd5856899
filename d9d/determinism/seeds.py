"""Which ranks share a random seed and which must differ.

The rule is decided per *purpose*, because the same two ranks must agree for one kind of randomness and
differ for another:

- `PARAMETERS` (weight init, stochastic rounding of updates): differs per pipeline stage (stages hold
  different layers) and is shared by every rank of a stage. Replicated parameters then come out identical
  on every dp/cp/tp replica without a broadcast, and sharded DTensor parameters are told apart by the
  DTensor RNG (see `dtensor_rng.py`), not by the seed.
- `ACTIVATIONS` (dropout and other per-token noise): differs per pipeline stage, data-parallel rank and
  context-parallel rank (they see different tokens) and is shared across tensor-parallel ranks (they hold
  the same replicated activations; sharded ones are again the DTensor RNG's job).
- `DATA` (shuffling, sampling order): the same everywhere, so the global sample order is one stream that
  every rank slices — which is what lets an elastic restart change the DP size without reordering data.

Seeds are mixed with BLAKE2b rather than Python's `hash`, so they are stable across processes, machines
and Python versions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from d9d.core.domains import MeshDomain, compute_layout
from d9d.core.mesh_params import DeviceMeshParameters


class SeedPurpose(StrEnum):
    PARAMETERS = "parameters"
    ACTIVATIONS = "activations"
    DATA = "data"


# Dims of the `regular` domain along which the seed of each purpose differs; it is shared along the rest.
VARYING_DIMS: Mapping[SeedPurpose, tuple[str, ...]] = {
    SeedPurpose.PARAMETERS: ("pp",),
    SeedPurpose.ACTIVATIONS: ("pp", "dp_replicate", "dp_shard", "cp"),
    SeedPurpose.DATA: (),
}

_SEED_BITS = 63  # fits torch.manual_seed and a signed int64 everywhere


def mix_seed(*parts: int | str) -> int:
    """A well-spread non-negative seed from any tuple of ints/strings (stable across processes)."""
    text = "\x1f".join(f"{type(p).__name__}:{p}" for p in parts)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << _SEED_BITS) - 1)


def derive_seed(base_seed: int, purpose: SeedPurpose | str, coordinates: Mapping[str, int]) -> int:
    """Seed for `purpose` at `coordinates` (a rank's `regular`-domain coordinates).

    Only the dims listed in `VARYING_DIMS[purpose]` enter the hash, so ranks that agree on them get the
    same seed. Every varying dim must be present in `coordinates`.
    """
    purp = SeedPurpose(purpose)
    missing = [d for d in VARYING_DIMS[purp] if d not in coordinates]
    if missing:
        raise KeyError(f"coordinates {dict(coordinates)} lack dims {missing} needed for {purp.value!r} seeds")
    parts: list[int | str] = [base_seed, purp.value]
    for dim in VARYING_DIMS[purp]:
        parts += [dim, coordinates[dim]]
    return mix_seed(*parts)


def stage_seed(rank_seed: int, position: int, stage_index: int) -> int:
    """The parameter seed of the `position`-th pipeline stage this rank holds (global index `stage_index`).
    `RankSeeds.parameters` differs per pipeline rank, which tells stages apart when a rank holds one; a rank
    holding several (ZBV, DualPipeV, interleaved 1F1B) seeds its later stages apart, or stages of the same
    layer shapes would be initialized, and their updates stochastically rounded, with the same draws. The
    first stage keeps the rank's seed, so one stage per rank is seeded as it always was."""
    return rank_seed if position == 0 else mix_seed(rank_seed, "stage", stage_index)


@dataclass(frozen=True)
class RankSeeds:
    """The seeds one rank uses, one per purpose."""

    parameters: int
    activations: int
    data: int

    @classmethod
    def for_rank(cls, params: DeviceMeshParameters, rank: int, base_seed: int) -> RankSeeds:
        coords = compute_layout(params, MeshDomain.REGULAR).coordinates(rank)
        return cls(
            parameters=derive_seed(base_seed, SeedPurpose.PARAMETERS, coords),
            activations=derive_seed(base_seed, SeedPurpose.ACTIVATIONS, coords),
            data=derive_seed(base_seed, SeedPurpose.DATA, coords),
        )
