"""The coordinator's journal: what a new coordinator needs to continue a run whose coordinator died.

`<run dir>/coordinator.json` holds the job spec as the coordinator ran it, how many attempts it started,
the commits it made, rank 0's loss per step up to the newest commit, the job's state, and where the
coordinator process lives (node, pid). The coordinator rewrites it atomically on every change of those;
nothing in it changes per step, so a long run writes it a few times per commit at most.

A journal whose state is not terminal means its coordinator died mid-run (its process was killed, its node
or the Ray head was lost, or a non-detached driver went away with it): `d9d resume RUN` and
`TrainingJob.attach` read it back, start a new coordinator, and that coordinator continues the attempt
numbering (the engine treats attempt > 0 as a restart that resumes from its own commits) and the history.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from d9d.cluster.spec import JobSpec, build_job
from d9d.cluster.state import JobState
from d9d.core.files import atomic_write_text
from d9d.engine.config import ConfigError, format_validation_error

JOURNAL_FILE = "coordinator.json"
JOURNAL_VERSION = 1
_log = logging.getLogger(__name__)


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CommitRecord(_Record):
    step: int = Field(ge=0)
    attempt: int = Field(ge=0)
    world_size: int = Field(ge=1)
    at: float  # wall clock


class Journal(_Record):
    version: int = JOURNAL_VERSION
    run_name: str
    launch_id: str
    # The job as run: the engine config with a `cluster:` section, directories absolute (`spec_data`).
    spec: dict[str, Any]
    state: JobState
    attempts: int = Field(0, ge=0)  # started so far, over every launch this journal continued
    commits: list[CommitRecord] = Field(default_factory=list)
    losses: dict[int, float] = Field(default_factory=dict)  # rank 0's, per step up to the newest commit
    launches: list[str] = Field(default_factory=list)  # launch ids, oldest first, this one last
    node_id: str = ""
    node_ip: str = ""
    pid: int = 0
    updated_at: float = 0.0

    @property
    def latest_commit(self) -> int | None:
        return self.commits[-1].step if self.commits else None

    @property
    def ended(self) -> bool:
        return self.state.terminal


def journal_path(run_dir: Path) -> Path:
    return run_dir / JOURNAL_FILE


def find_run_dir(run: str | Path, run_dir: Path | None = None) -> Path:
    """Where the journal of `run` is: `run_dir` when given, `run` itself when it is a run directory (one
    holding a journal), else `runs/<run>` (the default `run.dir`) under the working directory."""
    if run_dir is not None:
        return run_dir.resolve()
    path = Path(run)
    if journal_path(path).is_file():
        return path.resolve()
    return (Path("runs") / str(run)).resolve()


def spec_data(spec: JobSpec) -> dict[str, Any]:
    """The job as a job file would hold it (JSON-able): `build_job` turns it back into the same spec."""
    return {**spec.train.model_dump(mode="json"), "cluster": spec.cluster.model_dump(mode="json")}


def write_journal(run_dir: Path, journal: Journal) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    stamped = journal.model_copy(update={"updated_at": time.time()})
    atomic_write_text(journal_path(run_dir), stamped.model_dump_json(indent=1), fsync=True)


def read_journal(run_dir: Path) -> Journal | None:
    """The run's journal; None when it has none. Raises `ConfigError` naming the file when it is damaged."""
    path = journal_path(run_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return Journal.model_validate(json.loads(text))
    except ValueError as e:  # JSON syntax, or a ValidationError (a ValueError too)
        detail = format_validation_error(e) if isinstance(e, ValidationError) else str(e)
        raise ConfigError(f"{path}: not a d9d coordinator journal: {detail}") from None


def unfinished_journal(run_dir: Path, run_name: str) -> Journal | None:
    """The journal of a coordinator of `run_name` that died before the run ended (what a new coordinator
    continues); None when there is none, it ended, or it cannot be read (a warning says why)."""
    try:
        journal = read_journal(run_dir)
    except ConfigError as e:
        _log.warning("%s; the run's attempt numbering and commit history start afresh", e)
        return None
    if journal is None or journal.ended or journal.run_name != run_name:
        return None
    return journal


def spec_of(journal: Journal, run_dir: Path) -> JobSpec:
    """The journal's job, validated as a job file is. `run.resume_from` only seeds a run without commits
    of its own, so it is dropped once the run committed (the engine would otherwise refuse the launch)."""
    data = dict(journal.spec)
    if journal.commits and isinstance(data.get("run"), dict):
        data["run"] = {**data["run"], "resume_from": None}
    try:
        return build_job(data)
    except ConfigError as e:
        raise ConfigError(f"{journal_path(run_dir)}: the journal's job no longer validates: {e}") from None
