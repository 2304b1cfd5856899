"""Ray names of a run's actors, and waiting for a killed actor to give its name back."""

from __future__ import annotations

import time
from collections.abc import Sequence

import ray

NAMESPACE = "d9d"


def coordinator_name(run_name: str) -> str:
    return f"{run_name}/coordinator"


def rank_name(run_name: str, rank: int) -> str:
    return f"{run_name}/rank-{rank}"


def wait_names_free(names: Sequence[str], timeout_s: float) -> None:
    """Killed actors release their names asynchronously; the next attempt (or run) reuses them."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            time.sleep(0.05)
