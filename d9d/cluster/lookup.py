"""`d9d status/logs/stop RUN`: where a run is, from its name (see d9d.cluster.registry for what is
registered). A run is reached through, in order:

1. its Ray job, through the Jobs API at the dashboard address (`d9d submit`, `ray job submit`, or any run
   whose record names a submission);
2. its live coordinator, through a Ray address: `--address` when it is a GCS or client address, the one a
   live coordinator gives the dashboard's state API (`--address http://head:8265`), else the cluster address
   in the run's record (`d9d train`, `--detach`, a notebook);
3. its files: `run.json` and `run_summary.json` in the run directory or its storage root (a run that
   ended, or whose cluster is gone; a run of any launcher). `run_dir` and `root` may be storage URIs
   (`s3://bucket/runs/<run>`, `s3://bucket/runs`); `options` open them (an S3 endpoint, say).

A run whose files say it ended is not looked for on a cluster at all, and without an address given the
local default dashboard is asked only when the run's files do not answer or name a Ray job submission:
`d9d status` of a local run that ended reads two files and imports neither Ray nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from d9d.cluster.addresses import (
    LiveCoordinator,
    Submission,
    dashboard_address,
    given,
    is_dashboard,
    live_coordinators,
    ray_address,
    reachable,
)
from d9d.cluster.registry import DEFAULT_RUNS_ROOT, RunRecord, RunState, find_record, state_from_files
from d9d.core.storage import Location, location

if TYPE_CHECKING:
    from d9d.cluster.client import TrainingJob

_TERMINAL = ("finished", "stopped", "failed", "died")  # "died": a launch without Ray whose process is gone


@dataclass(frozen=True)
class Located:
    run_name: str
    record: RunRecord | None
    submission: Submission | None
    ray_address: str | None  # a reachable Ray address where the run's coordinator may live
    files: RunState | None  # what the run directory says about the recorded launch
    jobs_error: str | None = None  # why no Ray job was found (none of that name, or no dashboard there)
    live: LiveCoordinator | None = None  # the run's coordinator as the dashboard's state API lists it

    @property
    def ended(self) -> bool:
        return self.files is not None and self.files.state in _TERMINAL


def locate(
    run: str,
    address: str | None,
    run_dir: Location | None = None,
    root: Location = DEFAULT_RUNS_ROOT,
    options: Mapping[str, Any] | None = None,
) -> Located:
    """Raises `StorageError` naming the store when `run_dir` or `root` is a store that cannot be read."""
    record = find_record(run, run_dir, root)
    files = state_from_files(record, options) if record is not None else None
    ended = files is not None and files.state in _TERMINAL
    submission: Submission | None = None
    jobs_error: str | None = None
    live: LiveCoordinator | None = None
    dashboard = dashboard_address(address)
    submitted = record is not None and record.submission_id is not None
    if is_dashboard(dashboard) and (given(address) or record is None or submitted):
        if not reachable(dashboard):
            jobs_error = f"no Ray dashboard answers at {dashboard}"
        else:
            from d9d.cluster import submit as jobs

            try:
                submission = jobs.find(run, dashboard, record.submission_id if record else None)
            except Exception as e:  # no such job, or not a dashboard after all
                jobs_error = str(e) or repr(e)
            if not ended:
                try:
                    live = next(iter(live_coordinators(dashboard, run)), None)
                except Exception:  # an older Ray without the state API: the Jobs API answered above
                    live = None
    if record is None and live is not None and live.run_dir is not None:
        record = find_record(run, location(live.run_dir, options))  # a run outside the runs root
        files = state_from_files(record, options) if record is not None else None
    candidates: list[str | None] = []
    if not ended:
        candidates = [ray_address(address), live.ray_address if live else None]
        candidates.append(record.ray_address if record is not None else None)
    found = next((a for a in candidates if a and reachable(a)), None)
    return Located(run, record, submission, found, files, jobs_error, live)


def attach(located: Located) -> TrainingJob | None:
    """A handle to the run's live coordinator, or None when it has none (a lookup never starts one: a
    coordinator that died is `d9d resume`'s to replace)."""
    if located.ray_address is None or located.ended:
        return None
    import ray

    from d9d.cluster.client import TrainingJob, connect
    from d9d.cluster.names import NAMESPACE, coordinator_name

    connect(located.ray_address)
    try:
        ray.get_actor(coordinator_name(located.run_name), namespace=NAMESPACE)
        return TrainingJob.attach(located.run_name, address=located.ray_address)
    except (ValueError, RuntimeError):  # no actor of that name (or it died just now)
        return None
