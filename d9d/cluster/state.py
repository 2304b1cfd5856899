"""The job's lifecycle as data: states, the transitions allowed between them, and what clients read."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

from d9d.engine.run_files import SUMMARY_FILE as SUMMARY_FILE
from d9d.engine.run_files import RunSummary as RunSummary
from d9d.engine.run_files import launch_record as launch_record
from d9d.engine.run_files import read_launches as read_launches
from d9d.engine.run_files import record_launch as record_launch

MAX_NOTICES = 100  # kept in a status and a summary
_log = logging.getLogger(__name__)


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
    failures: int = 0  # attempts that failed so far (`last_failure` is the newest's reason)
    # What the coordinator said as it happened (storage stalls, ...): the newest `MAX_NOTICES`, of
    # `notice_count` so far.
    notices: tuple[str, ...] = ()
    notice_count: int = 0
    # The ranks' training state is in host memory (`TrainingJob.sleep`); the state is then PAUSED.
    asleep: bool = False
    standby_ready: int = 0  # warm standby ranks ready to be taken by a restart (`cluster.standby_ranks`)
    # The launch's start-up (d9d.cluster.control.startup): the phases ended so far with their seconds, and
    # the one in progress with the wall time it began (None once the first step was seen).
    startup: tuple[tuple[str, float], ...] = ()
    starting: tuple[str, float] | None = None
