"""Fault restart on one local Ray instance: a killed rank, a hung rank, a crash in the middle of a checkpoint
write; and the interactive client. Every faulty run must reproduce the failure-free run bit for bit."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from d9d.cluster import JobState, TrainingJob
from d9d.cluster.follow import follow
from d9d.cluster.names import NAMESPACE, rank_name
from d9d.cluster.spec import build_job
from d9d.engine.checkpoint import read_latest, verify_manifest
from d9d.tracking.history import RESTART, RESUMED_FROM, read_history
from tests.cluster_fixtures import reference_losses, toy_job, trained_samples, wait_for_step

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240), pytest.mark.usefixtures("_ray")]

STEPS = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Per-step losses of the failure-free run (2 data-parallel ranks, simulated exactly)."""
    return reference_losses(toy_job("reference", tmp_path_factory.mktemp("reference"), steps=STEPS), world=2)


def _losses(summary: Any) -> list[float]:
    return [summary.losses[s] for s in range(1, STEPS + 1)]


def test_killed_rank_restarts_from_checkpoint_with_identical_losses(
    tmp_path: Path, reference: list[float]
) -> None:
    job = TrainingJob(
        build_job(toy_job("kill", tmp_path, steps=STEPS, model={"options": {"step_sleep_s": 0.3}}))
    )
    job.start()
    wait_for_step(job, 5)
    ray.kill(ray.get_actor(rank_name("kill", 1), namespace=NAMESPACE))
    killed = time.monotonic()
    # Noticed through the actor's death, before the heartbeat timeout (10 s by default) could notice it;
    # how fast is benchmarks/cluster_overhead.py's business (0.02-0.08 s).
    while job.status().state in (JobState.RUNNING, JobState.PAUSED):
        assert time.monotonic() - killed < 8.0, "the dead rank was not noticed through its actor's death"
        time.sleep(0.02)
    console = io.StringIO()
    summary = follow(job, out=console, interactive=False)

    assert summary.status == "finished"
    assert summary.restarts == 1 and len(summary.failures) == 1
    assert summary.failures[0].startswith("rank 1: process died")
    # The console blames the killed rank, not the peer whose collective broke with it.
    (said,) = [line for line in console.getvalue().splitlines() if "attempt failed:" in line]
    assert said.startswith("[d9d] attempt failed: rank 1: process died"), said
    # The restart is announced and marked where it resumed: the history, and so the plot.
    resumed = summary.resumed_from[1]
    assert f"[d9d] attempt 1 restarts from step {resumed} (checkpoint " in console.getvalue()
    history = read_history(tmp_path / "history.jsonl")
    assert history[RESUMED_FROM] == {resumed + 1: resumed} and history[RESTART] == {resumed + 1: 1}
    assert summary.resumed_from[0] is None and summary.resumed_from[1] in (4, 6, 8)
    assert len(summary.recovery_times_s) == 1 and 0 < summary.recovery_times_s[0] < 60
    assert _losses(summary) == reference  # bitwise: resumed state and data position are exact
    on_disk = json.loads((tmp_path / "run_summary.json").read_text())
    assert on_disk["status"] == "finished" and on_disk["steps"] == STEPS and on_disk["restarts"] == 1
    assert on_disk["recovery_times_s"] == summary.recovery_times_s
    assert on_disk["final_loss"] == reference[-1] and on_disk["tokens_per_s"] > 0
    assert sorted(trained_samples(tmp_path)) == list(range(1, STEPS + 1))


def test_hung_rank_is_detected_by_the_step_timeout(tmp_path: Path, reference: list[float]) -> None:
    hang = {"kind": "hang", "step": 5, "rank": 1}
    job = toy_job(
        "hang", tmp_path, steps=STEPS, model={"options": {"faults": [hang]}}, timeouts={"step_s": 2}
    )
    started = time.monotonic()
    summary = TrainingJob(build_job(job)).start().result(timeout=180)

    assert summary.status == "finished", summary.error
    assert len(summary.failures) == 1 and "hang" in summary.failures[0]
    assert summary.resumed_from == [None, 4]
    assert _losses(summary) == reference
    assert time.monotonic() - started < 120  # the hang itself sleeps for an hour


def test_crash_during_checkpoint_write_keeps_previous_checkpoint(
    tmp_path: Path, reference: list[float]
) -> None:
    crash = {"kind": "exit_in_checkpoint", "step": 4, "rank": 1}
    job = toy_job("commit", tmp_path, steps=STEPS, model={"options": {"faults": [crash]}})
    summary = TrainingJob(build_job(job)).start().result(timeout=180)

    assert summary.status == "finished", summary.error
    assert len(summary.failures) == 1 and "rank 1" in summary.failures[0]
    assert summary.resumed_from == [None, 2]  # the half-written step 4 never became latest
    assert _losses(summary) == reference
    latest = read_latest(tmp_path / "checkpoints")
    assert latest is not None and latest.name.endswith(f"{STEPS:08d}")
    verify_manifest(latest)


def test_a_non_retryable_error_ends_the_run_without_a_restart(tmp_path: Path) -> None:
    """An error the ranks mark as not retryable (raised on every rank, as a bad input would be) ends the
    run at once, with budget left for retries: Ray re-raises it as a class that still derives from the
    rank's error type."""
    fatal = [{"kind": "raise_non_retryable", "step": 3, "rank": r} for r in range(2)]
    job = toy_job(
        "fatal", tmp_path, steps=STEPS, model={"options": {"faults": fatal}}, cluster={"max_failures": 3}
    )
    summary = TrainingJob(build_job(job)).start().result(timeout=180)

    assert summary.status == "failed"
    assert summary.restarts == 0 and summary.world_sizes == [2]
    assert len(summary.failures) == 1 and "NonRetryableError" in summary.failures[0]
    assert summary.error is not None and summary.error.startswith("not retryable: rank ")


def test_interactive_pause_checkpoint_update_resume_stop(tmp_path: Path) -> None:
    job = TrainingJob(
        build_job(
            toy_job(
                "interactive",
                tmp_path,
                steps=100_000,
                model={"options": {"step_sleep_s": 0.3}},
                checkpointing={"period": None},
            )
        )
    ).start()
    wait_for_step(job, 3)

    job.pause()
    deadline = time.monotonic() + 30
    while job.status().state is not JobState.PAUSED:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    paused_step = job.status().step  # `paused` means the ranks stopped, not that the command was sent
    time.sleep(1.0)
    assert job.status().step == paused_step, "training went on while paused"

    job.checkpoint_now()
    while job.status().latest_checkpoint_step != paused_step:
        assert time.monotonic() < deadline + 30
        time.sleep(0.05)
    latest = read_latest(tmp_path / "checkpoints")
    assert latest is not None and latest.name.endswith(f"{paused_step:08d}")

    job.update(lr=0.0125)
    job.resume()
    job.wait(step=paused_step + 5, timeout=60)
    job.stop()
    summary = job.result(timeout=60)

    assert summary.status == "stopped"
    assert paused_step + 5 <= summary.steps < 100_000
    lrs = {}
    for point in TrainingJob.attach("interactive").metrics(timeout=5):  # a fresh handle replays the buffer
        if point.kind == "train":
            lrs[point.step] = point.values["lr"]
    assert {lrs[s] for s in lrs if s <= paused_step} == {0.05}
    assert {lrs[s] for s in lrs if s > paused_step} == {0.0125}
