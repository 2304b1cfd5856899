"""Head or driver loss: the coordinator's journal, and a run continued after its coordinator's process was
SIGKILLed mid-run, by `d9d resume` and by `TrainingJob.attach`, with losses bit for bit those of a run
that was never interrupted and every sample trained exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from d9d.cli.main import main
from d9d.cluster import JobState, TrainingJob, build_job
from d9d.cluster.control.journal import (
    CommitRecord,
    Journal,
    find_run_dir,
    read_journal,
    spec_data,
    spec_of,
    unfinished_journal,
    write_journal,
)
from d9d.cluster.names import NAMESPACE, coordinator_name
from d9d.engine.config import ConfigError
from tests.cluster_fixtures import reference_losses, toy_job, trained_samples

STEPS = 10
REPO = Path(__file__).resolve().parents[1]


def _job(name: str, run_dir: Path) -> dict[str, Any]:
    return toy_job(name, run_dir, steps=STEPS, model={"options": {"step_sleep_s": 0.2}})


# -- the journal on its own (no Ray) ----------------------------------------------------------------------


def test_journal_round_trips_the_job_and_refuses_damage(tmp_path: Path) -> None:
    spec = build_job(_job("j", tmp_path / "run"))
    journal = Journal(
        run_name="j",
        launch_id="L1",
        spec=spec_data(spec),
        state=JobState.RUNNING,
        attempts=2,
        commits=[CommitRecord(step=4, attempt=1, world_size=2, at=1.0)],
        losses={3: 0.5, 4: 0.25},
    )
    write_journal(spec.run_dir, journal)
    back = read_journal(spec.run_dir)
    assert back is not None and back.model_dump(exclude={"updated_at"}) == journal.model_dump(
        exclude={"updated_at"}
    )
    assert spec_of(back, spec.run_dir) == spec  # the same job, validated as a job file is
    assert unfinished_journal(spec.run_dir, "j") == back
    assert unfinished_journal(spec.run_dir, "other-run") is None
    assert find_run_dir(spec.run_dir) == spec.run_dir
    write_journal(spec.run_dir, journal.model_copy(update={"state": JobState.FINISHED}))
    assert unfinished_journal(spec.run_dir, "j") is None  # an ended run is not continued

    (spec.run_dir / "coordinator.json").write_text('{"run_name": 3}')
    with pytest.raises(ConfigError, match=r"coordinator\.json: not a d9d coordinator journal"):
        read_journal(spec.run_dir)
    assert unfinished_journal(spec.run_dir, "j") is None  # warned, and started afresh


def test_resume_refuses_a_run_without_journal_or_already_ended(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"coordinator\.json does not exist"):
        TrainingJob.resume_run(tmp_path / "nothing")
    spec = build_job(_job("ended", tmp_path / "run"))
    # (A stopped run is resumed: its stop committed the step it stopped at; `test_cluster_driver_faults`.)
    journal = Journal(run_name="ended", launch_id="L", spec=spec_data(spec), state=JobState.FINISHED)
    write_journal(spec.run_dir, journal)
    with pytest.raises(RuntimeError, match="already ended \\(finished\\)"):
        TrainingJob.resume_run(spec.run_dir)
    with pytest.raises(RuntimeError, match="journal of run 'ended', not of 'other'"):
        TrainingJob.resume_run(spec.run_dir, run_name="other")
    assert main(["resume", "ended", "--run-dir", str(spec.run_dir)]) == 2


# -- a coordinator killed mid-run -------------------------------------------------------------------------


def _kill_paused_coordinator(job: TrainingJob, step: int, attempts: int) -> Journal:
    """Once `step` was trained, pause the run (so no commit can land meanwhile), then SIGKILL its
    coordinator's process, found through the journal, and wait until the handle `job` saw it go."""
    job.wait(step=step, timeout=120)
    job.pause()
    deadline = time.monotonic() + 60
    while (journal := read_journal(job.spec.run_dir)) is None or journal.state is not JobState.PAUSED:
        assert time.monotonic() < deadline, f"the journal never said paused: {journal}"
        time.sleep(0.05)
    assert journal.attempts == attempts and journal.commits
    assert journal.pid == ray.get(_coordinator(job.run_name).journal.remote()).pid
    os.kill(journal.pid, signal.SIGKILL)
    while job.status().state is not JobState.FAILED:  # the handle notices the loss
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return journal


def _coordinator(run_name: str) -> Any:
    return ray.get_actor(coordinator_name(run_name), namespace=NAMESPACE)


_DRIVER = """
import json, os, signal, sys, time
import ray
from d9d.cluster import JobState, TrainingJob, build_job
ray.init(address=sys.argv[1], log_to_driver=False)
job = TrainingJob(build_job(json.loads(sys.argv[2]))).start()
job.wait(step=2, timeout=120)
job.pause()  # held, so the test sees where the run was when its driver died
while job.status().state is not JobState.PAUSED:
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)  # the driver dies without a word
"""


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("_ray")
def test_driver_and_coordinator_sigkilled_run_continues_bitwise(tmp_path: Path) -> None:
    """A detached run outlives its SIGKILLed driver; its coordinator SIGKILLed, `TrainingJob.attach`
    starts a new one from the journal; that one SIGKILLed too, `d9d resume` starts a third and follows the
    run to its end. Losses bit for bit those of an uninterrupted run, every sample trained once."""
    run_dir, name = tmp_path / "run", "headloss"
    config = {**_job(name, run_dir), "cluster": {**_job(name, run_dir)["cluster"], "detach": True}}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    gcs = ray.get_runtime_context().gcs_address
    driver = subprocess.run(
        [sys.executable, "-c", _DRIVER, gcs, json.dumps(config)],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=240,
    )
    assert driver.returncode == -signal.SIGKILL, driver.stderr[-3000:]

    job = TrainingJob.attach(name)  # the coordinator the dead driver started
    assert job.status().state is JobState.PAUSED
    job.resume()
    first = _kill_paused_coordinator(job, 5, attempts=1)
    assert len(first.launches) == 1  # the same coordinator all along

    # No coordinator lives: attach starts one from the journal.
    attached = TrainingJob.attach(name, run_dir=run_dir)
    assert attached.run_name == name and attached.spec.cluster.detach
    second = _kill_paused_coordinator(attached, 8, attempts=2)
    assert second.launches == [first.launch_id, second.launch_id]

    # `d9d resume` from the journal, following the run to its end as `d9d train` does.
    assert main(["resume", str(run_dir)]) == 0
    TrainingJob.attach(name).close()  # the finished detached coordinator would otherwise linger

    summary = json.loads((run_dir / "run_summary.json").read_text())  # the last launch's record
    assert summary["status"] == "finished", summary.get("error")
    # Two ranks: the reference is bit for bit what gloo sums (see its docstring); the steps before the
    # last commit come from the journal, the others were trained by the last coordinator's ranks.
    reference = reference_losses(_job(name, run_dir), world=2)
    assert [summary["losses"][str(s)] for s in range(1, STEPS + 1)] == reference
    assert summary["resumed_from"] == [second.commits[-1].step]
    journal = read_journal(run_dir)
    assert journal is not None and journal.state is JobState.FINISHED and journal.attempts == 3
    assert journal.launches == [*second.launches, journal.launch_id]
    steps_by_attempt = {c.step: c.attempt for c in journal.commits}
    assert steps_by_attempt[first.commits[-1].step] == 0 and steps_by_attempt[STEPS] == 2
    assert main(["resume", str(run_dir)]) == 2  # ended: nothing left to resume
    # Each coordinator's ranks ran as a new attempt; in the run's final history every sample was trained
    # exactly once.
    batch = 8
    assert trained_samples(run_dir) == {
        s: list(range((s - 1) * batch, s * batch)) for s in range(1, STEPS + 1)
    }
