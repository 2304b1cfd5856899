"""Ray Jobs API side of the CLI: `d9d submit` ships `d9d train` as a Ray job; `status`, `logs` and `stop`
find a run's latest submission by the run name stored in the job's metadata."""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray.job_submission import JobStatus as RayJobStatus
from ray.job_submission import JobSubmissionClient

from d9d.cluster.addresses import DEFAULT_DASHBOARD as DEFAULT_DASHBOARD
from d9d.cluster.addresses import RUN_KEY, Submission
from d9d.cluster.addresses import dashboard_address as dashboard_address
from d9d.cluster.lease import check_no_live_launch
from d9d.cluster.names import NAMESPACE, coordinator_name
from d9d.cluster.reach import pin_relative_paths
from d9d.cluster.runtime_env import RuntimeEnvConfig, with_runtime_env
from d9d.cluster.spec import build_job
from d9d.engine.config import apply_overrides, read_config_file

# How long Ray's job supervisor waits after the SIGTERM of `ray job stop` / `d9d stop` before its SIGKILL.
# Ray's default (3 s) kills `d9d train` before the coordinator has torn the ranks down, written the
# `stopped` summary and ended the tracker run as killed; the supervisor reads it from the job's env.
STOP_WAIT_S = 120


def submit(
    config: Path,
    address: str,
    *,
    overrides: Sequence[str] = (),
    working_dir: Path | None = None,
    num_workers: int | None = None,
    cpu: bool = False,
    runtime_env: RuntimeEnvConfig | None = None,
) -> Submission:
    """Validate the job here, then run `d9d train` on the cluster with `working_dir` uploaded.

    The job's `cluster.runtime_env`, with `runtime_env` (the command line's) merged over it, becomes the
    Ray job's runtime environment: Ray uploads its local parts from here, and the driver on the cluster
    and every actor it starts run in it. The cluster-side `d9d train` is told to add none of its own (the
    local paths of the job file do not exist there)."""
    data = with_runtime_env(apply_overrides(read_config_file(config), overrides), runtime_env)
    spec = build_job(data, num_workers=num_workers, cpu=cpu)
    check_no_live_launch(spec.run_dir)  # the job's own `d9d train` checks again, on the cluster
    pinned = pin_relative_paths(data, spec)
    env = spec.cluster.runtime_env or RuntimeEnvConfig()
    if env.working_dir is not None and "://" in env.working_dir:
        raise ValueError(
            f"cluster.runtime_env.working_dir {env.working_dir} is remote; d9d submit uploads a local "
            "working directory holding the job file (--working-dir)"
        )
    if (
        working_dir is not None
        and env.working_dir is not None
        and working_dir.resolve() != Path(env.working_dir)
    ):
        raise ValueError(
            f"--working-dir {working_dir} and cluster.runtime_env.working_dir {env.working_dir} disagree"
        )
    root = (working_dir or (Path(env.working_dir) if env.working_dir else None) or Path.cwd()).resolve()
    try:
        relative = config.resolve().relative_to(root)
    except ValueError:
        raise ValueError(
            f"config {config} is not inside the working directory {root}; pass --working-dir"
        ) from None
    command = ["python", "-m", "d9d.cli.main", "train", str(relative)]
    for item in [*overrides, *pinned.overrides, "cluster.runtime_env=null"]:
        command += ["--set", item]
    if num_workers is not None:
        command += ["--num-workers", str(num_workers)]
    if cpu:
        command.append("--cpu")
    client = JobSubmissionClient(address)
    submission_id = client.submit_job(
        entrypoint=shlex.join(command),
        runtime_env={
            **env.to_ray(),
            "working_dir": str(root),
            "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S), **env.env_vars, **pinned.env},
        },
        metadata={RUN_KEY: spec.run_name},
        submission_id=f"d9d-{spec.run_name}-{int(time.time() * 1000)}",
    )
    return Submission(submission_id, spec.run_name, RayJobStatus.PENDING.value, "")


def find(run: str, address: str, submission_id: str | None = None) -> Submission:
    """The newest submission of run `run`: tagged with its name (`d9d submit`), the submission with that id
    (or with `submission_id`, from the run's record), or the Ray job that created the run's coordinator
    (`ray job submit -- d9d train ...`)."""
    client = JobSubmissionClient(address)
    listed = client.list_jobs()
    ids = {run} if submission_id is None else {run, submission_id}
    # Drivers that were not submitted (`d9d train`, a notebook) are listed too, without a submission id.
    submitted = [j for j in listed if j.submission_id]
    jobs = [j for j in submitted if j.submission_id in ids or (j.metadata or {}).get(RUN_KEY) == run]
    if not jobs:
        creator = coordinator_job_id(run, address)
        jobs = [j for j in submitted if creator is not None and j.job_id == creator]
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


def coordinator_job_id(run: str, address: str) -> str | None:
    """The Ray job that created the run's coordinator (the live one if there is one), from the state API."""
    from ray.util.state import list_actors

    name = coordinator_name(run)
    actors: list[Any] = list_actors(
        address=address, filters=[("ray_namespace", "=", NAMESPACE), ("name", "=", name)], limit=1000
    )
    if not actors:
        return None
    actor = next((a for a in actors if a.state == "ALIVE"), actors[-1])
    job_id: str | None = actor.job_id
    return job_id


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


def submitted_runs(address: str) -> list[tuple[str, str, bool]]:
    """(run, Ray job status, whether that status is terminal) of every job submitted with a run's name
    (`d9d submit`) at the dashboard `address`, newest last."""
    jobs = sorted(JobSubmissionClient(address).list_jobs(), key=lambda j: j.start_time or 0)
    out = []
    for job in jobs:
        name = (job.metadata or {}).get(RUN_KEY)
        if name:
            status = RayJobStatus(job.status)
            out.append((str(name), status.value, status.is_terminal()))
    return out
