"""The job's lifecycle as data: states, the transitions allowed between them, and what clients read."""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from d9d.core.storage import Location, move_tree, write_text

SUMMARY_FILE = "run_summary.json"
MAX_NOTICES = 100  # kept in a status and a summary
_log = logging.getLogger(__name__)
# `record_launch` reads, updates and rewrites the file: threads of one process take turns (the coordinator
# writes from its event loop and its threads, a driver from whichever thread saw the coordinator die).
_RECORD_LOCK = threading.Lock()


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


@dataclass
class RunSummary:
    """What `run_summary.json` holds."""

    run_name: str
    status: str
    steps: int
    restarts: int
    recovery_times_s: list[float] = field(default_factory=list)
    # Per recovery (same order): seconds per phase, see `d9d.cluster.control.recovery.PHASES`.
    recovery_phases_s: list[dict[str, float]] = field(default_factory=list)
    final_loss: float | None = None
    tokens_per_s: float | None = None
    resizes: int = 0
    world_sizes: list[int] = field(default_factory=list)  # per attempt
    resumed_from: list[int | None] = field(default_factory=list)  # checkpoint step per attempt
    failures: list[str] = field(default_factory=list)
    standby_pids: list[int] = field(default_factory=list)  # every warm standby started, in order
    standby_ranks_used: list[int] = field(default_factory=list)  # per attempt: ranks taken from standbys
    losses: dict[int, float] = field(default_factory=dict)  # per step, as finally trained
    error: str | None = None
    notices: list[str] = field(default_factory=list)  # storage stalls and the like, as they happened
    # Why a stopped run stopped, when its stop said (`preempted: SIGTERM to the driver`, `d9d stop`).
    stop_reason: str | None = None
    # Which launch of the run this is (`TrainingJob.start` picks it): a file holds one record per launch.
    launch_id: str = ""
    ended_at: float | None = None  # wall clock

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["losses"] = {str(k): v for k, v in sorted(self.losses.items())}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSummary:
        """A record (or a whole `run_summary.json`, whose top level is its latest launch)."""
        values = {k: v for k, v in data.items() if k != "launches"}
        values["losses"] = {int(k): float(v) for k, v in values.get("losses", {}).items()}
        return cls(**values)


def read_launches(path: Location) -> list[dict[str, Any]] | None:
    """The launch records of a `run_summary.json` (an older file without `launches` is one record); None
    when the file exists but cannot be read."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    launches = data.get("launches")
    if isinstance(launches, list):
        return [r for r in launches if isinstance(r, dict)]
    return [data]


def record_launch(run_dir: Location, summary: RunSummary) -> None:
    """Add (or update) this launch's record in `run_dir/run_summary.json`.

    Every launch keeps its own record under `launches`, so a failed relaunch never erases what an earlier
    launch finished; the top level repeats the latest record's fields for readers of the one-record
    format. An unreadable file is moved aside, not overwritten: it may be the only record of a launch."""
    with _RECORD_LOCK:
        _record_launch(run_dir, summary)


def _record_launch(run_dir: Location, summary: RunSummary) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SUMMARY_FILE
    record = summary.to_json()
    launches = read_launches(path)
    if launches is None:
        aside = path.parent / f"{path.name}.unreadable-{int(time.time())}"
        _log.warning("%s cannot be read; moved to %s", path, aside.name)
        move_tree(path, aside)
        launches = []
    for i, old in enumerate(launches):
        if summary.launch_id and old.get("launch_id") == summary.launch_id:
            launches[i] = record
            break
    else:
        launches.append(record)
    write_text(path, json.dumps({**record, "launches": launches}, indent=1))


def launch_record(run_dir: Location, launch_id: str) -> RunSummary | None:
    """This launch's record in `run_summary.json`, if it has one."""
    for record in read_launches(run_dir / SUMMARY_FILE) or []:
        if record.get("launch_id") == launch_id:
            return RunSummary.from_json(record)
    return None
