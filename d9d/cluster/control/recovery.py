"""Where a recovery's time goes: the controller's and the new ranks' timestamps, cut into phases.

A recovery runs from the detection of a failure to the first step completed by the new ranks (the existing
`recovery_times_s`). Its phases, in order, each ending where the next begins:

- `retries`: from the first failure to the last one of a chain (a failure while recovering from another
  continues the same recovery); 0 for a single failure;
- `teardown`: killing the failed attempt's ranks and giving its bundles back;
- `backoff`: the restart backoff (`cluster.restart_backoff_s`);
- `place`: reserving the new placement group, and picking the checkpoint to resume from;
- `start`: starting the rank actors (a warm standby is already started), rendezvous, until the last rank
  entered its `run`;
- `init_process_group`, `build`, `load`: rank 0's setup (`d9d.cluster.rank.SETUP_KEYS`);
- `first_step`: from rank 0's first step boundary to the coordinator seeing the first step completed.

They sum to the recovery time. `detect` precedes it and is not part of the sum: from the failed attempt's
quietest rank's last heartbeat to the detection, an upper bound on how long the failure went unnoticed.

Timestamps are wall-clock seconds, the only clock the coordinator and the ranks share; on several nodes a
skew between their clocks moves time between adjacent phases (a phase that would come out negative is 0,
the next one absorbs it), never changes the sum.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from d9d.cluster.rank import setup_marks
from d9d.engine.runtime import MetricPoint

PHASES = (
    "retries",
    "teardown",
    "backoff",
    "place",
    "start",
    "init_process_group",
    "build",
    "load",
    "first_step",
)
DETECT = "detect"


@dataclass(frozen=True)
class RankSetup:
    run_at: float
    process_group_at: float
    built_at: float | None
    loaded_at: float | None


@dataclass
class RecoveryClock:
    """One recovery's timestamps (wall clock), filled in as the controller moves through it."""

    detected: float
    detect_s: float
    last_detected: float = 0.0
    torn_down: float | None = None
    reserving: float | None = None  # the backoff is over
    placed: float | None = None
    metrics_seq: int = 0  # the new attempt's points come after this one
    world_size: int = 0
    first_step: float | None = None
    ranks: dict[int, RankSetup] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.last_detected = self.last_detected or self.detected

    def failed_again(self, now: float) -> None:
        """Another failure before the recovery completed: the next attempt's marks start over."""
        self.last_detected = now
        self.torn_down = self.reserving = self.placed = self.first_step = None
        self.ranks.clear()

    def note_points(self, points: Iterable[MetricPoint]) -> None:
        for point in points:
            marks = setup_marks(point)
            if marks is not None:
                self.ranks[point.rank] = RankSetup(*marks)

    @property
    def complete(self) -> bool:
        """The first step was seen and every rank's setup point arrived."""
        return self.first_step is not None and len(self.ranks) >= self.world_size

    def phases(self) -> dict[str, float]:
        assert self.first_step is not None
        rank0 = self.ranks.get(0)
        started = max((r.run_at for r in self.ranks.values()), default=None)
        ends: list[float | None] = [
            self.last_detected,
            self.torn_down,
            self.reserving,
            self.placed,
            started,
            rank0.process_group_at if rank0 else None,
            rank0.built_at if rank0 else None,
            rank0.loaded_at if rank0 else None,
            self.first_step,
        ]
        return split(self.detected, ends, self.detect_s)


def split(start: float, ends: list[float | None], detect_s: float) -> dict[str, float]:
    """Phase durations from the end of each (None: not seen, the phase takes 0 and the next one its time);
    a phase ending before the previous one (clock skew) takes 0 too. The last end is always known."""
    out = {DETECT: max(detect_s, 0.0)}
    prev = start
    for name, end in zip(PHASES, ends, strict=True):
        at = prev if end is None else max(end, prev)
        out[name] = at - prev
        prev = at
    return out


def detect_seconds(heartbeats: Mapping[int, float], detected_monotonic: float) -> float:
    """From the oldest of the ranks' latest heartbeats (monotonic) to the detection; 0 with none seen."""
    if not heartbeats:
        return 0.0
    return max(detected_monotonic - min(heartbeats.values()), 0.0)


def wall_now() -> float:
    return time.time()
