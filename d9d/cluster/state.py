"""The job's lifecycle as data: states, the transitions allowed between them, and what clients read."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class JobState(enum.StrEnum):
    PENDING = "pending"
    STARTING = "starting"  # reserving resources, starting rank actors, rendezvous
    RUNNING = "running"
    PAUSED = "paused"
    RESTARTING = "restarting"  # ranks torn down after a failure or for a resize; about to start again
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (JobState.FINISHED, JobState.STOPPED, JobState.FAILED)


_END = {JobState.FINISHED, JobState.STOPPED, JobState.FAILED}
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.STARTING} | _END),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.PAUSED, JobState.RESTARTING} | _END),
    JobState.RUNNING: frozenset({JobState.PAUSED, JobState.RESTARTING} | _END),
    JobState.PAUSED: frozenset({JobState.RUNNING, JobState.RESTARTING} | _END),
    JobState.RESTARTING: frozenset({JobState.STARTING} | _END),
    JobState.FINISHED: frozenset(),
    JobState.STOPPED: frozenset(),
    JobState.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


class StateMachine:
    def __init__(self) -> None:
        self.state = JobState.PENDING
        self.history: list[tuple[float, JobState]] = [(time.time(), JobState.PENDING)]

    def to(self, new: JobState) -> None:
        if new == self.state:
            return
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"job state cannot go from {self.state.value} to {new.value}")
        self.state = new
        self.history.append((time.time(), new))


@dataclass(frozen=True)
class JobStatus:
    """A snapshot for clients (`TrainingJob.status()`, `d9d status`)."""

    run_name: str
    state: JobState
    step: int  # last completed step seen by the coordinator
    total_steps: int
    attempt: int
    world_size: int
    data_parallel: int
    restarts: int
    latest_checkpoint_step: int | None
    last_loss: float | None
    last_failure: str | None = None
    error: str | None = None


@dataclass
class RunSummary:
    """What `run_summary.json` holds."""

    run_name: str
    status: str
    steps: int
    restarts: int
    recovery_times_s: list[float] = field(default_factory=list)
    final_loss: float | None = None
    tokens_per_s: float | None = None
    resizes: int = 0
    world_sizes: list[int] = field(default_factory=list)  # per attempt
    resumed_from: list[int | None] = field(default_factory=list)  # checkpoint step per attempt
    failures: list[str] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)  # per step, as finally trained
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["losses"] = {str(k): v for k, v in sorted(self.losses.items())}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSummary:
        values = dict(data)
        values["losses"] = {int(k): float(v) for k, v in values.get("losses", {}).items()}
        return cls(**values)
