"""Seed and snapshot every random number generator a training process draws from.

A resumed run reproduces the interrupted one only if *all* generators continue where they stopped: Python's
`random` (user code, some samplers), NumPy's legacy global generator (augmentations), torch's CPU generator
and the generator of the CUDA device this rank drives (a rank uses one device; other devices' generators
belong to other ranks). The snapshot holds only tensors, ints, strings and lists so it survives
`torch.load(..., weights_only=True)` inside a checkpoint.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

_NUMPY_SEED_MOD = 2**32  # numpy's legacy seeding accepts [0, 2**32)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy, torch CPU and (lazily, via torch) every CUDA device."""
    random.seed(seed)
    np.random.seed(seed % _NUMPY_SEED_MOD)
    torch.manual_seed(seed)


def _cuda_ready() -> bool:
    # Capturing must not be what creates a CUDA context (that would pin memory on device 0 of every rank).
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if _cuda_ready():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`; the CUDA part goes to the current device."""
    for key in ("python", "numpy", "torch"):
        if key not in state:
            raise KeyError(f"RNG snapshot lacks {key!r} (has {sorted(state)})")
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["kind"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
