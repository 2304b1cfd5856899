"""Reproducibility: per-coordinate seeds, DTensor-consistent init, RNG snapshots for checkpoints."""

from d9d.determinism.dtensor_rng import full_tensor_random, parameter_init_rng, seed_dtensor_rng
from d9d.determinism.rng_state import capture_rng_state, restore_rng_state, seed_everything
from d9d.determinism.seeds import VARYING_DIMS, RankSeeds, SeedPurpose, derive_seed, mix_seed, stage_seed

__all__ = [
    "VARYING_DIMS",
    "RankSeeds",
    "SeedPurpose",
    "capture_rng_state",
    "derive_seed",
    "full_tensor_random",
    "mix_seed",
    "parameter_init_rng",
    "restore_rng_state",
    "seed_dtensor_rng",
    "seed_everything",
    "stage_seed",
]
