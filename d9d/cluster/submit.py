"""Ray Jobs API side of the CLI: `d9d submit` ships `d9d train` as a Ray job; `status`, `logs` and `stop`
find a run's latest submission by the run name stored in the job's metadata."""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.job_submission import JobStatus as RayJobStatus
from ray.job_submission import JobSubmissionClient

from d9d.cluster.names import NAMESPACE
from d9d.cluster.reach import pin_relative_paths
from d9d.cluster.spec import load_job
from d9d.engine.config import apply_overrides, read_config_file

RUN_KEY = "d9d_run"
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"
# How long Ray's job supervisor waits after the SIGTERM of `ray job stop` / `d9d stop` before its SIGKILL.
# Ray's default (3 s) kills `d9d train` before the coordinator has torn the ranks down, written the
# `stopped` summary and ended the tracker run as killed; the supervisor reads it from the job's env.
STOP_WAIT_S = 120


def dashboard_address(address: str | None) -> str:
    """The Jobs API address: given, or RAY_API_SERVER_ADDRESS, or an http RAY_ADDRESS, or the local head."""
    if address:
        return address
    for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        value = os.environ.get(var, "")
        if value.startswith(("http://", "https://")):
            return value
    return DEFAULT_DASHBOARD


@dataclass(frozen=True)
class Submission:
    submission_id: str
    run_name: str
    status: str
    message: str


def submit(
    config: Path,
    address: str,
    *,
    overrides: Sequence[str] = (),
    working_dir: Path | None = None,
    num_workers: int | None = None,
    cpu: bool = False,
) -> Submission:
    """Validate the job here, then run `d9d train` on the cluster with `working_dir` uploaded."""
    spec = load_job(config, overrides, num_workers=num_workers, cpu=cpu)
    pinned = pin_relative_paths(apply_overrides(read_config_file(config), overrides), spec)
    root = (working_dir or Path.cwd()).resolve()
    try:
        relative = config.resolve().relative_to(root)
    except ValueError:
        raise ValueError(
            f"config {config} is not inside the working directory {root}; pass --working-dir"
        ) from None
    command = ["python", "-m", "d9d.cli.main", "train", str(relative)]
    for item in [*overrides, *pinned.overrides]:
        command += ["--set", item]
    if num_workers is not None:
        command += ["--num-workers", str(num_workers)]
    if cpu:
        command.append("--cpu")
    client = JobSubmissionClient(address)
    submission_id = client.submit_job(
        entrypoint=shlex.join(command),
        runtime_env={
            "working_dir": str(root),
            "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S), **pinned.env},
        },
        metadata={RUN_KEY: spec.run_name},
        submission_id=f"d9d-{spec.run_name}-{int(time.time() * 1000)}",
    )
    return Submission(submission_id, spec.run_name, RayJobStatus.PENDING.value, "")


def find(run: str, address: str) -> Submission:
    """The newest submission of run `run` (or the submission with that id)."""
    client = JobSubmissionClient(address)
    jobs = [j for j in client.list_jobs() if j.submission_id == run or (j.metadata or {}).get(RUN_KEY) == run]
    if not jobs:
        raise LookupError(f"no Ray job for run {run!r} at {address}")
    job = max(jobs, key=lambda j: j.start_time or 0)
    assert job.submission_id is not None
    run_name = (job.metadata or {}).get(RUN_KEY, run)
    return Submission(job.submission_id, run_name, RayJobStatus(job.status).value, job.message or "")


def rank_actors(run: str, address: str) -> list[tuple[str, str]]:
    """(name, state) of the run's coordinator and rank actors, from the Ray state API."""
    from ray.util.state import list_actors

    actors: list[Any] = list_actors(
        address=address, filters=[("ray_namespace", "=", NAMESPACE)], limit=10_000
    )
    prefix = f"{run}/"
    return sorted((a.name, a.state) for a in actors if a.name and a.name.startswith(prefix))


def logs(submission_id: str, address: str) -> str:
    text: str = JobSubmissionClient(address).get_job_logs(submission_id)
    return text


def stop(submission_id: str, address: str, timeout_s: float = STOP_WAIT_S + 30.0) -> str:
    """Ask Ray to stop the job (SIGTERM to `d9d train`, which stops the run) and wait until it ended:
    `d9d train` returns once the coordinator acknowledged the stop and wrote the run's summary."""
    client = JobSubmissionClient(address)
    client.stop_job(submission_id)
    deadline = time.monotonic() + timeout_s
    status = client.get_job_status(submission_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(submission_id)
    return RayJobStatus(status).value
