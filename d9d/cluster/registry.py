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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from d9d.cluster.state import SUMMARY_FILE, read_launches
from d9d.core.storage import Location, StorageError, location, write_text

if TYPE_CHECKING:
    from d9d.cluster.spec import JobSpec

RECORD_FILE = "run.json"
DEFAULT_RUNS_ROOT = Path("runs")
# Set by Ray's job supervisor for a job's driver: the job's runtime env and metadata (with its submission id).
_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
_SUBMISSION_KEY = "job_submission_id"
_log = logging.getLogger(__name__)


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
        )

    def files(self, options: Mapping[str, Any] | None = None) -> Location:
        """Where the run's durable files are (`run_summary.json`, checkpoints, mirrored tracker files);
        `options` open a storage URI (an S3 endpoint, say)."""
        if self.storage_root is None:
            return Path(self.run_dir)
        return location(self.storage_root, options)


@dataclass(frozen=True)
class RunState:
    """What `d9d list` shows for one run: from the live coordinator, else from the files."""

    run_name: str
    state: str  # a JobState value, or "started" when a launch has no recorded end and no live coordinator
    step: int | None
    last_loss: float | None
    run_dir: str | None
    source: str  # "coordinator" or "files"


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
    )
    text = json.dumps(asdict(record), indent=1)
    for where in [spec.run_dir, root] if elsewhere else [spec.run_dir]:
        try:
            write_text(where / RECORD_FILE, text)
        except Exception as e:  # an OSError, or whatever the store's client raises
            _log.warning("run %s: cannot write %s: %s", spec.run_name, where / RECORD_FILE, e)


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


def records(root: Location) -> list[RunRecord]:
    """The registered runs directly under `root` (the default `runs/`, or a storage root such as
    `s3://bucket/runs`). A store that cannot be listed raises `StorageError` naming it."""
    try:
        listed: list[Location] = list(root.iterdir()) if root.is_dir() else []
        children = sorted((d for d in listed if d.is_dir()), key=str)
    except Exception as e:
        raise StorageError(f"cannot list the runs under {root}: {e}") from e
    found = (read_record(d) for d in children)
    return [r for r in found if r is not None]


def find_record(
    run: str, run_dir: Location | None = None, root: Location = DEFAULT_RUNS_ROOT
) -> RunRecord | None:
    """The record of run `run`: in `run_dir` if given, else in `root/run`, else any under `root`."""
    if run_dir is not None:
        return read_record(run_dir)
    record = read_record(root / run)
    if record is not None:
        return record
    return next((r for r in records(root) if r.run_name == run), None)


def state_from_files(record: RunRecord, options: Mapping[str, Any] | None = None) -> RunState:
    """The state of a launch from the `run_summary.json` of its storage root: its record for this launch
    if it ended; "unreadable" when the store cannot be asked."""
    try:
        launches = read_launches(record.files(options) / SUMMARY_FILE) or []
    except Exception as e:  # StorageError, or whatever the store's client raises
        _log.warning("run %s: cannot read %s: %s", record.run_name, record.storage_root, e)
        return RunState(record.run_name, "unreadable", None, None, record.run_dir, "files")
    for launch in launches:
        if launch.get("launch_id") == record.launch_id:
            losses = launch.get("losses") or {}
            loss = launch.get("final_loss")
            if loss is None and losses:
                loss = losses[max(losses, key=int)]
            return RunState(
                record.run_name, str(launch.get("status")), launch.get("steps"), loss, record.run_dir, "files"
            )
    return RunState(record.run_name, "started", None, None, record.run_dir, "files")


def live_states() -> list[RunState]:
    """Every run with a live coordinator in the connected cluster (`ray.init` done)."""
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
            )
        )
    return out
