"""Head or driver loss: the coordinator's journal, and a run continued after its coordinator's process was
SIGKILLed mid-run, by `d9d resume` and by `TrainingJob.attach`, with losses bit for bit those of a run
that was never interrupted and every sample trained exactly once."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
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
    with pytest.raises(ConfigError, match="coordinator.json: not a d9d coordinator journal"):
        read_journal(spec.run_dir)
    assert unfinished_journal(spec.run_dir, "j") is None  # warned, and started afresh


def test_resume_refuses_a_run_without_journal_or_already_ended(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="coordinator.json does not exist"):
        TrainingJob.resume_run(tmp_path / "nothing")
    spec = build_job(_job("ended", tmp_path / "run"))
    journal = Journal(run_name="ended", launch_id="L", spec=spec_data(spec), state=JobState.STOPPED)
    write_journal(spec.run_dir, journal)
    with pytest.raises(RuntimeError, match="already ended \\(stopped\\)"):
        TrainingJob.resume_run(spec.run_dir)
    assert main(["resume", "ended", "--run-dir", str(spec.run_dir)]) == 2


# -- a coordinator killed mid-run -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def _ray() -> Iterator[None]:
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _kill_coordinator_after(job: TrainingJob, step: int) -> Journal:
    """SIGKILL the coordinator's process (found through its journal) once `step` was trained."""
    for point in job.metrics(timeout=120):
        if point.kind == "train" and point.step >= step:
            break
    journal = read_journal(job.spec.run_dir)
    assert journal is not None and journal.state is JobState.RUNNING and journal.attempts == 1
    assert journal.commits and journal.pid == ray.get(_coordinator(job.run_name).journal.remote()).pid
    os.kill(journal.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while job.status().state is not JobState.FAILED:  # this driver notices the loss
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return journal


def _coordinator(run_name: str) -> Any:
    return ray.get_actor(coordinator_name(run_name), namespace=NAMESPACE)


def _check_continued(run_dir: Path, killed: Journal) -> None:
    summary = json.loads((run_dir / "run_summary.json").read_text())  # the resumed launch's record
    assert summary["status"] == "finished", summary.get("error")
    reference = reference_losses(_job("ref", run_dir), world=2)  # two ranks: bitwise (see its docstring)
    assert [summary["losses"][str(s)] for s in range(1, STEPS + 1)] == reference
    newest = killed.commits[-1].step
    assert summary["resumed_from"] == [newest]  # from the newest commit the dead coordinator made
    journal = read_journal(run_dir)
    assert journal is not None and journal.state is JobState.FINISHED
    assert journal.attempts == 2 and journal.launches == [killed.launch_id, journal.launch_id]
    assert [c.attempt for c in journal.commits if c.step <= newest] == [0] * len(killed.commits)
    assert {c.attempt for c in journal.commits if c.step > newest} == {1}
    # The new coordinator's ranks ran as attempt 1 (attempt 0's sample log stays); no sample was lost
    # or trained twice in the run's final history.
    batch = 8
    assert trained_samples(run_dir) == {s: list(range((s - 1) * batch, s * batch)) for s in range(1, STEPS + 1)}


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_d9d_resume_continues_after_the_coordinator_is_sigkilled(_ray: None, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = TrainingJob(build_job(_job("headloss", run_dir))).start()
    killed = _kill_coordinator_after(job, 5)
    assert main(["resume", str(run_dir)]) == 0
    _check_continued(run_dir, killed)
    assert main(["resume", str(run_dir)]) == 2  # ended: nothing left to resume


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_attach_starts_a_new_coordinator_when_none_lives(_ray: None, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = TrainingJob(build_job(_job("headloss-attach", run_dir))).start()
    killed = _kill_coordinator_after(job, 3)
    attached = TrainingJob.attach("headloss-attach", run_dir=run_dir)
    assert attached.result(timeout=180).status == "finished"
    _check_continued(run_dir, killed)
