"""Faults around the driver (issue 29): the coordinator dying under `follow()` and `status()` racing each
other, SIGTERM to `d9d train` (a preemption) and `d9d resume` after it, and the summary written from two
threads at once."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from d9d.cli import exit_codes
from d9d.cli.main import main
from d9d.cluster import JobState, TrainingJob, build_job
from d9d.cluster.follow import follow
from d9d.core.files import atomic_write
from d9d.engine.checkpoint import read_latest
from d9d.tracking.history import RESTART, RESUMED_FROM, read_history
from d9d.tracking.plot import Marker, markers
from tests.cluster_fixtures import reference_losses, toy_job, trained_samples


def test_two_threads_writing_one_file_never_share_a_temporary_name(tmp_path: Path) -> None:
    """Both threads are inside their write at once: with one temporary name per process, the second
    rename found nothing to move (FileNotFoundError) — what `status()` beside `follow()` hit."""
    target = tmp_path / "run_summary.json"
    both_writing = threading.Barrier(2, timeout=10)
    errors: list[BaseException] = []

    def write(payload: bytes) -> None:
        def body(f: Any) -> None:
            f.write(payload)
            both_writing.wait()

        try:
            atomic_write(target, body)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(p,)) for p in (b'{"a": 1}', b'{"b": 2}')]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(target.read_text()) in ({"a": 1}, {"b": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["run_summary.json"]  # no temporary file left


def _slow_toy(name: str, run_dir: Path, steps: int, **sections: Any) -> dict[str, Any]:
    return toy_job(name, run_dir, steps=steps, model={"options": {"step_sleep_s": 0.25}}, **sections)


@pytest.mark.ray
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("_ray")
def test_coordinator_death_ends_follow_with_a_clear_error_recorded_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import d9d.cluster.client as client

    recorded: list[str] = []
    real_record = client.record_launch

    def counting_record(run_dir: Any, summary: Any) -> None:
        recorded.append(summary.status)
        real_record(run_dir, summary)

    monkeypatch.setattr(client, "record_launch", counting_record)
    job = TrainingJob(build_job(_slow_toy("lost", tmp_path, steps=1000))).start()
    pid = ray.get(job._coordinator.journal.remote()).pid

    stop = threading.Event()
    status_errors: list[BaseException] = []
    states: list[JobState] = []

    def poll_status() -> None:  # a notebook cell, a dashboard: status() beside follow()
        while not stop.is_set():
            try:
                states.append(job.status().state)
            except BaseException as e:
                status_errors.append(e)
                return
            time.sleep(0.01)

    def kill_coordinator() -> None:
        job.wait(step=3, timeout=120)
        os.kill(pid, signal.SIGKILL)

    threads = [threading.Thread(target=poll_status), threading.Thread(target=kill_coordinator)]
    for t in threads:
        t.start()
    console = io.StringIO()
    try:
        summary = follow(job, out=console, interactive=False)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)

    assert status_errors == []
    assert states[-1] is JobState.FAILED
    assert job.coordinator_lost and exit_codes.of_run(job, summary) == exit_codes.COORDINATOR_LOST
    assert summary.status == "failed" and summary.error is not None
    assert summary.error.startswith("coordinator lost: the coordinator of run lost died")
    assert f"d9d resume {tmp_path}" in summary.error
    assert "run lost failed" in console.getvalue() and "d9d resume" in console.getvalue()
    assert recorded == ["failed"]  # once, by whichever thread saw the loss first
    on_disk = json.loads((tmp_path / "run_summary.json").read_text())
    assert on_disk["status"] == "failed" and on_disk["error"] == summary.error
    assert not list(tmp_path.glob(".run_summary.json.tmp-*"))


@pytest.mark.ray
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_ray")
def test_sigterm_to_d9d_train_commits_the_current_step_and_d9d_resume_continues(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A preemption mid-run, between commits (every 5 steps): `d9d train` stops the ranks at the next step
    boundary, which they commit, and exits with PREEMPTED; `d9d resume` trains the rest. No step before
    the signal is trained again or lost, and the losses are those of an uninterrupted run, bit for bit."""
    steps = 14
    job = _slow_toy("preempt", tmp_path / "run", steps, checkpointing={"period": 5, "keep_last": 3})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    at_signal: list[int] = []

    def preempt() -> None:
        deadline = time.monotonic() + 120
        while True:  # the run's handle, as another client would take it
            try:
                handle = TrainingJob.attach("preempt")
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        status = handle.wait(step=6, timeout=120)
        at_signal.append(status.step)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=preempt)
    killer.start()
    previous = signal.getsignal(signal.SIGTERM)
    started = time.monotonic()
    try:
        rc = main(["train", str(job_file)])
    finally:
        killer.join(timeout=60)
        signal.signal(signal.SIGTERM, previous)
    took = time.monotonic() - started

    assert rc == exit_codes.PREEMPTED
    first = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert first["status"] == "stopped" and first["stop_reason"] == "preempted: SIGTERM to the driver"
    stopped_at = first["steps"]
    assert 6 <= at_signal[0] <= stopped_at < steps, (at_signal, stopped_at)
    latest = read_latest(tmp_path / "run" / "checkpoints")
    assert latest is not None and latest.name.endswith(f"{stopped_at:08d}")  # not step 5
    assert took < 120

    capsys.readouterr()
    assert main(["resume", str(tmp_path / "run")]) == exit_codes.FINISHED
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["status"] == "finished" and summary["resumed_from"] == [stopped_at]
    # The resume is announced on the console and in the summary, marked in the history (what the tracker
    # got too) where `d9d plot` draws it, and `d9d status` tells it.
    checkpoint = tmp_path / "run" / "checkpoints" / f"step-{stopped_at:08d}"
    said = f"run preempt resumes from step {stopped_at} (checkpoint {checkpoint})"
    assert f"[d9d] {said}" in capsys.readouterr().out and said in summary["notices"]
    history = read_history(tmp_path / "run" / "history.jsonl")
    assert history[RESUMED_FROM] == {stopped_at + 1: stopped_at} and history[RESTART] == {stopped_at + 1: 0}
    assert markers(history) == [Marker(stopped_at + 1, stopped_at, restart=False)]
    assert (
        main(["status", "preempt", "--run-dir", str(tmp_path / "run"), "--address", "http://127.0.0.1:1"])
        == 0
    )
    assert f"  restarts:    0; resumed from step {stopped_at}" in capsys.readouterr().out
    launches = summary["launches"]
    losses = {**launches[0]["losses"], **launches[1]["losses"]}
    assert [losses[str(s)] for s in range(1, steps + 1)] == reference_losses(job, world=2)
    batch = 8
    assert trained_samples(tmp_path / "run") == {
        s: list(range((s - 1) * batch, s * batch)) for s in range(1, steps + 1)
    }


@pytest.mark.ray
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("_ray")
def test_d9d_stop_commits_the_current_step_first_and_now_kills_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = ray.get_runtime_context().gcs_address
    runs = {}
    for name in ("graceful", "now"):
        spec = build_job(_slow_toy(name, tmp_path / name, 1000, checkpointing={"period": 50}))
        runs[name] = TrainingJob(spec).start()
    for name, job in runs.items():
        job.wait(step=4, timeout=120)
        args = ["stop", name, "--address", address, "--run-dir", str(tmp_path / name)]
        assert main([*args, "--now"] if name == "now" else args) == 0

    graceful = runs["graceful"].result(timeout=30)
    assert graceful.status == "stopped" and graceful.stop_reason == "d9d stop" and graceful.steps >= 4
    latest = read_latest(tmp_path / "graceful" / "checkpoints")
    assert latest is not None and latest.name.endswith(f"{graceful.steps:08d}")  # nothing lost
    assert f"run graceful: stopped after {graceful.steps} steps; latest commit: step {graceful.steps}" in (
        capsys.readouterr().out
    )
    now = runs["now"].result(timeout=30)
    assert now.status == "stopped" and now.stop_reason == "d9d stop --now"
    assert read_latest(tmp_path / "now" / "checkpoints") is None  # killed: the steps since step 0 are lost
