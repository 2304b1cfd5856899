"""Finding a run by its name, however it was started (`d9d train`, `--detach`, `d9d submit`, `ray job
submit`, a notebook).

Two registrations, written when a run starts:

- the coordinator actor is named `<run>/coordinator` in Ray's `d9d` namespace (d9d.cluster.names): while it
  lives, any driver of the cluster reaches the run through it, and the Ray state API says which Ray job
  created it (so a `ray job submit` run maps to its submission);
- `<run dir>/run.json` (`RunRecord`): the run's name, the launch, the cluster's address and the Ray job
  (its submission id when the driver runs as a Ray job). It outlives the cluster; with the
  `run_summary.json` of its storage root (written at the end of every launch), it says how the run ended.
  A run with a storage root elsewhere (`run.storage`) writes the same record there too, so the registry
  of every run is the storage root itself: `d9d list --runs-root s3://bucket/runs` lists them, and
  `d9d status s3://bucket/runs/<run>` reads one, from any machine that reaches the store.

`d9d status/logs/stop RUN` and `d9d list` read both.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from d9d.core.storage import Location, StorageError
from d9d.engine.run_files import (
    CHECKPOINTS_DIR,
    SUMMARY_FILE,
    infer_record,
    newest_commit,
    read_launches,
    state_without_end,
    tracker_lines,
    write_record,
)
from d9d.engine.run_files import RECORD_FILE as RECORD_FILE
from d9d.engine.run_files import RunRecord as RunRecord
from d9d.engine.run_files import read_record as read_record

if TYPE_CHECKING:
    from d9d.cluster.spec import JobSpec

DEFAULT_RUNS_ROOT = Path("runs")
# Set by Ray's job supervisor for a job's driver: the job's runtime env and metadata (with its submission id).
_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
_SUBMISSION_KEY = "job_submission_id"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunState:
    """What `d9d list` shows for one run: from the live coordinator, else from the files."""

    run_name: str
    # A JobState value; for a launch with no recorded end, `running`/`died` (its process on this host),
    # `started` (no live coordinator asked), or `no record` (d9d.engine.run_files.state_without_end).
    state: str
    step: int | None
    last_loss: float | None
    run_dir: str | None
    source: str  # "coordinator" or "files"
    launcher: str = "ray"  # RunRecord.launcher


def submission_id_of_this_driver() -> str | None:
    raw = os.environ.get(_JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        metadata = json.loads(raw).get("metadata") or {}
    except (ValueError, AttributeError):
        return None
    value = metadata.get(_SUBMISSION_KEY)
    return value if isinstance(value, str) else None


def register_run(spec: JobSpec, launch_id: str) -> None:
    """Write `run.json` for this launch into the run directory and, when it is elsewhere, the storage root
    (best effort: a driver that cannot write them, e.g. a Ray client outside the cluster, still has the
    named coordinator)."""
    import ray

    from d9d.cluster.spec import tracker_config

    context = ray.get_runtime_context()
    address: str | None = None
    job_id: str | None = None
    try:
        job_id = context.get_job_id()
        address = context.gcs_address
    except Exception:  # a Ray client has no GCS address of its own: the named coordinator still works
        _log.debug("run %s: no Ray address to record", spec.run_name, exc_info=True)
    root = spec.storage_root
    elsewhere = not (isinstance(root, Path) and root.resolve() == spec.run_dir.resolve())
    record = RunRecord(
        run_name=spec.run_name,
        run_dir=str(spec.run_dir),
        launch_id=launch_id,
        started_at=time.time(),
        ray_address=address,
        ray_job_id=job_id,
        submission_id=submission_id_of_this_driver(),
        detach=spec.cluster.detach,
        driver=f"{socket.gethostname()}:{os.getpid()}",
        storage_root=str(root) if elsewhere else None,
        launcher="ray",
        total_steps=spec.train.trainer.total_steps,
        trackers=tracker_lines(tracker_config(spec), spec.run_dir),
    )
    for where in [spec.run_dir, root] if elsewhere else [spec.run_dir]:
        try:
            write_record(record, where)
        except Exception as e:  # an OSError, or whatever the store's client raises
            _log.warning("run %s: cannot write %s: %s", spec.run_name, where / RECORD_FILE, e)


def _record_of(run_dir: Location) -> RunRecord | None:
    """The run.json of `run_dir`, else, for a local directory holding a run's files without one (a run of
    an older d9d), a record inferred from them."""
    record = read_record(run_dir)
    if record is None and isinstance(run_dir, Path):
        record = infer_record(run_dir)
    return record


def records(root: Location) -> list[RunRecord]:
    """The runs directly under `root` (the default `runs/`, or a storage root such as `s3://bucket/runs`),
    whichever launcher made them. A store that cannot be listed raises `StorageError` naming it."""
    try:
        listed: list[Location] = list(root.iterdir()) if root.is_dir() else []
        children = sorted((d for d in listed if d.is_dir()), key=str)
    except Exception as e:
        raise StorageError(f"cannot list the runs under {root}: {e}") from e
    found = (_record_of(d) for d in children)
    return [r for r in found if r is not None]


def find_record(
    run: str, run_dir: Location | None = None, root: Location = DEFAULT_RUNS_ROOT
) -> RunRecord | None:
    """The record of run `run`: in `run_dir` if given, else in `root/run`, else any under `root`."""
    if run_dir is not None:
        return _record_of(run_dir)
    record = _record_of(root / run)
    if record is not None:
        return record
    return next((r for r in records(root) if r.run_name == run), None)


def launch_of(record: RunRecord, options: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The `run_summary.json` record of the record's launch (of a record inferred from the files: the
    newest launch there); None when it has none. Raises what the store raises."""
    launches = read_launches(record.files(options) / SUMMARY_FILE) or []
    if record.launcher == "unknown":
        return launches[-1] if launches else None
    return next((launch for launch in launches if launch.get("launch_id") == record.launch_id), None)


def state_from_files(record: RunRecord, options: Mapping[str, Any] | None = None) -> RunState:
    """The state of a launch from the `run_summary.json` of its storage root: its record for this launch
    if it has one; while it has none of the launch's end, what the directory tells (`state_without_end`:
    `running`, `died`, `started`, or for a directory without `run.json` `finished` or `no record`), with
    the step and loss from history.jsonl (or its newest commit); "unreadable" when the store cannot be
    asked."""
    from d9d.tracking.history import HISTORY_FILE, last_values

    def state(value: str, step: int | None, loss: float | None) -> RunState:
        return RunState(record.run_name, value, step, loss, record.run_dir, "files", record.launcher)

    try:
        launch = launch_of(record, options)
        if launch is None or launch.get("status") in ("starting", "pending"):
            files = record.files(options)
            step, loss = last_values(files / HISTORY_FILE)
            commit = None
            if record.launcher == "unknown":  # its commits may say how far it got
                commit = newest_commit(files / CHECKPOINTS_DIR)
                if commit is not None and (step is None or commit.step > step):
                    step = commit.step
            return state(state_without_end(record, commit), step, loss)
    except Exception as e:  # StorageError, or whatever the store's client raises
        _log.warning("run %s: cannot read %s: %s", record.run_name, record.storage_root or record.run_dir, e)
        return state("unreadable", None, None)
    losses = launch.get("losses") or {}
    loss = launch.get("final_loss")
    if loss is None and losses:
        loss = losses[max(losses, key=int)]
    return state(str(launch.get("status")), launch.get("steps"), loss)


def live_states() -> list[RunState]:
    """Every run with a live coordinator in the connected cluster (`ray.init` done)."""
    import ray
    from ray.util import list_named_actors

    from d9d.cluster.names import NAMESPACE
    from d9d.cluster.state import JobStatus

    out = []
    for entry in list_named_actors(all_namespaces=True):
        name, namespace = entry["name"], entry["namespace"]
        if namespace != NAMESPACE or not name.endswith("/coordinator"):
            continue
        try:
            handle: Any = ray.get_actor(name, namespace=NAMESPACE)
            status: JobStatus = ray.get(handle.status.remote(), timeout=30)
        except Exception:  # died between the listing and the call
            continue
        spec: JobSpec = ray.get(handle.spec.remote(), timeout=30)
        out.append(
            RunState(
                status.run_name,
                status.state.value,
                status.step,
                status.last_loss,
                str(spec.run_dir),
                "coordinator",
                "ray",
            )
        )
    return out
