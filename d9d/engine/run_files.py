"""The files every launcher writes into a run directory (its storage root, `run.storage`, when elsewhere),
whatever started it (`d9d train` and the rest on Ray, `torchrun`, `python -m d9d.engine.launch`):

- `run.json` (`RunRecord`): the run's name, the launch, how it was launched, and for a run on Ray the
  cluster's address and Ray job (d9d.cluster.registry). `d9d list/status/logs` find runs by it.
- `run_summary.json` (`RunSummary`): one record per launch, written when the launch starts and when it
  ends: its status, steps, losses, restarts, failures, start-up phases.

Neither torch nor Ray is imported here: the command line reads these files.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from d9d.core.storage import Location, StorageError, location, move_tree, write_text

if TYPE_CHECKING:
    import psutil

    from d9d.tracking import TrackerConfig

RECORD_FILE = "run.json"
SUMMARY_FILE = "run_summary.json"
#: Rank log files (`<run dir>/logs/rank<r>.log`, written by d9d.cluster's rank actors).
LOGS_DIR = "logs"
_log = logging.getLogger(__name__)
# `record_launch` reads, updates and rewrites the file: threads of one process take turns (the coordinator
# writes from its event loop and its threads, a driver from whichever thread saw the coordinator die).
_RECORD_LOCK = threading.Lock()


@dataclass(frozen=True)
class RunRecord:
    run_name: str
    run_dir: str
    launch_id: str
    started_at: float  # wall clock
    ray_address: str | None  # the cluster's GCS address, for `ray.init` / `d9d ... --address`
    ray_job_id: str | None  # the Ray job of the driver that started the run
    submission_id: str | None  # when that driver is a Ray job (`d9d submit`, `ray job submit`)
    detach: bool
    driver: str  # host:pid of the driver
    storage_root: str | None = None  # the run's durable files (`run.storage`) when not in run_dir
    # What started it: "ray" (`d9d train`, `d9d submit`, `TrainingJob`), "torchrun" or "process"
    # (`python -m d9d.engine.launch`), "script" (a script driving the Trainer, `recorded_train`); "unknown"
    # for a run directory that has no run.json (`infer_record`).
    launcher: str = "ray"
    total_steps: int | None = None  # trainer.total_steps of the launch
    # Each tracker of the launch: (kind, the command that opens it, or where it keeps the run).
    trackers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        def text(key: str) -> str | None:
            value = data.get(key)
            return value if isinstance(value, str) else None

        return cls(
            run_name=str(data["run_name"]),
            run_dir=str(data["run_dir"]),
            launch_id=text("launch_id") or "",
            started_at=float(data.get("started_at") or 0.0),
            ray_address=text("ray_address"),
            ray_job_id=text("ray_job_id"),
            submission_id=text("submission_id"),
            detach=bool(data.get("detach")),
            driver=text("driver") or "",
            storage_root=text("storage_root"),
            launcher=text("launcher") or "ray",
            total_steps=data["total_steps"] if isinstance(data.get("total_steps"), int) else None,
            trackers=tuple(
                (str(t[0]), str(t[1]))
                for t in data.get("trackers") or ()
                if isinstance(t, list | tuple) and len(t) == 2
            ),
        )

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["trackers"] = [list(t) for t in self.trackers]
        return data

    def files(self, options: Mapping[str, Any] | None = None) -> Location:
        """Where the run's durable files are (`run_summary.json`, checkpoints, mirrored tracker files);
        `options` open a storage URI (an S3 endpoint, say)."""
        if self.storage_root is None:
            return Path(self.run_dir)
        return location(self.storage_root, options)


def read_record(run_dir: Location) -> RunRecord | None:
    """The record in `run_dir` (a run directory, or a run's storage root); None when it has none. A store
    that cannot be asked raises `StorageError` naming it."""
    path = run_dir / RECORD_FILE
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return None
    except Exception as e:
        if isinstance(path, Path) and isinstance(e, OSError):
            return None  # an unreadable local folder is not a run of this root (as before storage roots)
        raise StorageError(f"cannot read {path}: {e}") from e
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or "run_name" not in data or "run_dir" not in data:
        return None
    return RunRecord.from_json(data)


# What makes a directory without run.json a run: any of these (a run of an older d9d, or one whose launcher
# could not write its record).
_RUN_MARKERS = (SUMMARY_FILE, "history.jsonl", "checkpoints", "coordinator.json", "metrics.jsonl")


def infer_record(run_dir: Path) -> RunRecord | None:
    """A record for a local run directory that has no run.json but holds a run's files; None otherwise."""
    try:
        if not any((run_dir / marker).exists() for marker in _RUN_MARKERS):
            return None
        started = min((run_dir / m).stat().st_mtime for m in _RUN_MARKERS if (run_dir / m).exists())
    except OSError:
        return None
    return RunRecord(
        run_name=run_dir.name,
        run_dir=str(run_dir),
        launch_id="",
        started_at=started,
        ray_address=None,
        ray_job_id=None,
        submission_id=None,
        detach=False,
        driver="",
        launcher="unknown",
    )


# The checkpoint layout d9d.engine.checkpoint writes (which imports torch; the command line reads it here).
CHECKPOINTS_DIR = "checkpoints"  # under a run directory
_STEP_PREFIX = "step-"
_MANIFEST = "manifest.json"
_TRAIN_CONFIG = "train_config.json"
#: The state of a run directory that records neither its launch nor its end (`state_without_end`).
UNRECORDED = "no record"
#: Launchers without Ray: their record's `driver` is rank 0's process (`d9d stop` sends it SIGTERM).
PROCESS_LAUNCHERS = ("process", "torchrun", "script")


@dataclass(frozen=True)
class Commit:
    step: int
    total_steps: int | None  # the run's length, as the config that wrote the commit says


def newest_commit(checkpoints: Location) -> Commit | None:
    """The newest committed step under `checkpoints` (a step directory with its manifest) and the run
    length its `train_config.json` names; None without one."""
    try:
        found = []
        for step_dir in checkpoints.glob(f"{_STEP_PREFIX}*"):
            suffix = step_dir.name[len(_STEP_PREFIX) :]
            if suffix.isdigit():
                found.append((int(suffix), step_dir))
        for step, step_dir in sorted(found, key=lambda f: f[0], reverse=True):
            if not (step_dir / _MANIFEST).is_file():
                continue
            try:
                trainer = json.loads((step_dir / _TRAIN_CONFIG).read_text()).get("trainer") or {}
                total = trainer.get("total_steps")
            except (OSError, ValueError, AttributeError):
                total = None
            return Commit(step, total if isinstance(total, int) else None)
    except OSError:
        return None
    return None


def driver_host_pid(driver: str) -> tuple[str, int] | None:
    """(host, pid) of a record's `driver` (`host:pid`); None when it names no pid."""
    host, _, pid = driver.rpartition(":")
    return (host, int(pid)) if pid.isdigit() else None


def local_process(driver: str, started_at: float) -> psutil.Process | None:
    """The live process a record names (`host:pid`) when it runs on this host and is the recorded one;
    None when it ended (a zombie has), runs elsewhere, or its pid now belongs to a later process."""
    import psutil

    named = driver_host_pid(driver)
    if named is None or named[0] != socket.gethostname():
        return None
    try:
        process = psutil.Process(named[1])
        # A later process that got the same pid started after the record was written.
        if process.status() != psutil.STATUS_ZOMBIE and process.create_time() <= started_at + 1.0:
            return process
    except psutil.Error:
        pass
    return None


def process_alive(driver: str, started_at: float) -> bool | None:
    """Whether the process a record names (`host:pid`, started before `started_at`) still runs; None when
    it ran on another host, which cannot be asked from here."""
    named = driver_host_pid(driver)
    if named is None or named[0] != socket.gethostname():
        return None
    return local_process(driver, started_at) is not None


def state_without_end(record: RunRecord, commit: Commit | None) -> str:
    """The state of a launch with no recorded end (no `run_summary.json` record of it, or one that says
    `starting`), from what its run directory does tell:

    - a directory without `run.json` (a script that drove the `Trainer` without `recorded_train`, or an
      older d9d): `finished` when its newest commit (`commit`, from `newest_commit`: the caller reads it
      once, for the step it shows too) is its last step, else `no record` (`UNRECORDED`);
    - a launch without Ray (a process, torchrun's rank 0, a script) on this host: `running` while its
      process lives, `died` when that process is gone without recording an end (killed, or lost);
    - else `started`: a Ray run whose coordinator was not asked, or a process on another host."""
    if record.launcher == "unknown":
        if commit is not None and commit.total_steps is not None and commit.step >= commit.total_steps:
            return "finished"
        return UNRECORDED
    if record.launcher in PROCESS_LAUNCHERS:
        alive = process_alive(record.driver, record.started_at)
        if alive is not None:
            return "running" if alive else "died"
    return "started"


def tracker_lines(config: TrackerConfig, run_dir: Path) -> tuple[tuple[str, str], ...]:
    """(kind, the command that opens it or where it is) of each tracker, as run.json records them."""
    from d9d.tracking import tracker_locations

    return tuple((loc.kind, loc.command or loc.where) for loc in tracker_locations(config, run_dir))


def write_record(record: RunRecord, where: Location) -> None:
    write_text(where / RECORD_FILE, json.dumps(record.to_json(), indent=1))


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
    # Seconds per start-up phase of the launch, to its first step (d9d.cluster.control.startup.PHASES).
    startup_s: dict[str, float] = field(default_factory=dict)

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
