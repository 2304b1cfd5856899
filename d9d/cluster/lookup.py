"""`d9d status/logs/stop RUN`: where a run is, from its name (see d9d.cluster.registry for what is
registered). A run is reached through, in order:

1. its Ray job, through the Jobs API at the dashboard address (`d9d submit`, `ray job submit`, or any run
   whose record names a submission);
2. its live coordinator, through a Ray address: `--address` when it is not an http(s) dashboard address,
   else the cluster address in the run's record (`d9d train`, `--detach`, a notebook);
3. its files: `run.json` and `run_summary.json` in the run directory or its storage root (a run that
   ended, or whose cluster is gone). `run_dir` and `root` may be storage URIs (`s3://bucket/runs/<run>`,
   `s3://bucket/runs`); `options` open them (an S3 endpoint, say).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from d9d.cluster import submit as jobs
from d9d.cluster.registry import DEFAULT_RUNS_ROOT, RunRecord, RunState, find_record, state_from_files
from d9d.core.storage import Location

if TYPE_CHECKING:
    from d9d.cluster.client import TrainingJob

_TERMINAL = ("finished", "stopped", "failed")


@dataclass(frozen=True)
class Located:
    run_name: str
    record: RunRecord | None
    submission: jobs.Submission | None
    ray_address: str | None  # a reachable Ray address where the run's coordinator may live
    files: RunState | None  # what the run directory says about the recorded launch
    jobs_error: str | None = None  # why no Ray job was found (none of that name, or no dashboard there)

    @property
    def ended(self) -> bool:
        return self.files is not None and self.files.state in _TERMINAL


def _is_dashboard(address: str) -> bool:
    return address.startswith(("http://", "https://"))


def _reachable(address: str, timeout_s: float = 2.0) -> bool:
    """A cheap check before `ray.init`, which waits a long time for a cluster that is gone."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.hostname is None or parts.port is None:
        return True  # "auto" and the like: let Ray resolve it
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return True
    except OSError:
        return False


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
    submission, jobs_error = None, None
    dashboard = jobs.dashboard_address(address)
    if _is_dashboard(dashboard):
        try:
            submission = jobs.find(run, dashboard, record.submission_id if record else None)
        except Exception as e:  # no dashboard there, or no such job
            jobs_error = str(e) or repr(e)
    candidates = [address if address and not _is_dashboard(address) else None]
    candidates.append(record.ray_address if record is not None else None)
    env = os.environ.get("RAY_ADDRESS")
    candidates.append(env if env and not _is_dashboard(env) else None)
    ray_address = next((a for a in candidates if a and _reachable(a)), None)
    return Located(run, record, submission, ray_address, files, jobs_error)


def attach(located: Located) -> TrainingJob | None:
    """A handle to the run's live coordinator, or None when it has none."""
    if located.ray_address is None or located.ended:
        return None
    from d9d.cluster.client import TrainingJob

    try:
        return TrainingJob.attach(located.run_name, address=located.ray_address)
    except ValueError:  # no actor of that name: the coordinator is gone
        return None
