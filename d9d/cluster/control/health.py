"""Failure detectors of a running attempt: small checks over what the coordinator learned about its ranks.

A rank that dies or raises is seen directly (its `run` call fails); these catch the ones that do not: ranks
that stop beating, a job that stops making progress, and ranks that never return while the others did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from d9d.cluster.control.failure import RankError
from d9d.cluster.control.outcome import Failed


@dataclass(frozen=True)
class Limits:
    step_timeout_s: float
    init_timeout_s: float
    heartbeat_timeout_s: float


@dataclass
class Liveness:
    """What the coordinator knows of an attempt's ranks, updated by their calls (monotonic seconds)."""

    world_size: int
    heartbeats: dict[int, float] = field(default_factory=dict)  # last heartbeat per rank
    progress: float = field(default_factory=time.monotonic)  # last step boundary or checkpoint call
    step_done: bool = False  # a step completed in this attempt
    returned: frozenset[int] = frozenset()  # ranks whose `run` returned
    first_returned: float | None = None
    errors: list[RankError] = field(default_factory=list)  # in the order they arrived (`seen_at` set)


HealthCheck = Callable[[Liveness, Limits, float, bool], Failed | None]


def stragglers(live: Liveness, limits: Limits, now: float, paused: bool) -> Failed | None:
    """Some ranks returned and the rest did not follow within a step timeout."""
    if live.first_returned is None or now - live.first_returned <= limits.step_timeout_s:
        return None
    missing = sorted(set(range(live.world_size)) - live.returned)
    return Failed(f"ranks {missing} did not finish {limits.step_timeout_s}s after the others", hung=True)


def missed_heartbeats(live: Liveness, limits: Limits, now: float, paused: bool) -> Failed | None:
    for rank, seen in live.heartbeats.items():
        if now - seen > limits.heartbeat_timeout_s:
            return Failed(f"rank {rank}: no heartbeat for {now - seen:.1f}s", hung=True)
    return None


def hang(live: Liveness, limits: Limits, now: float, paused: bool) -> Failed | None:
    """No step boundary (or checkpoint call) for too long; a paused job is not expected to move."""
    limit = limits.step_timeout_s if live.step_done else limits.init_timeout_s
    if paused or now - live.progress <= limit:
        return None
    what = "step" if live.step_done else "first step (init timeout)"
    return Failed(f"hang: no {what} completed for {now - live.progress:.1f}s (limit {limit}s)", hung=True)


CHECKS: tuple[HealthCheck, ...] = (stragglers, missed_heartbeats, hang)


def first_failure(
    live: Liveness, limits: Limits, now: float, paused: bool, checks: Sequence[HealthCheck] = CHECKS
) -> Failed | None:
    for check in checks:
        failure = check(live, limits, now, paused)
        if failure is not None:
            return failure
    return None
