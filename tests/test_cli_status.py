"""`d9d status` as a reader sees it: a short summary of a run read from its files or its live coordinator
(state, step/total, loss, tokens/s, ETA, restarts and resumes, the error, where things are), the raw record
with `--json`, and nothing but silence when its reader goes away (`d9d status RUN | head`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from d9d.cli.main import main
from d9d.cluster.overview import format_overview, overview_from_status
from d9d.cluster.state import JobState, JobStatus

REPO = Path(__file__).resolve().parents[1]


def _run_dir(root: Path, name: str, *, launch: dict | None, steps: list[int], now: float) -> Path:
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-00000020")
    record = {
        "run_name": name,
        "run_dir": str(run),
        "launch_id": "L2",
        "started_at": now - 100,
        "ray_address": None,
        "ray_job_id": None,
        "submission_id": None,
        "detach": False,
        "driver": "host:1",
        "launcher": "ray",
        "total_steps": 100,
        "trackers": [["mlflow", f"mlflow ui --backend-store-uri sqlite:///{run}/mlflow.db"]],
    }
    (run / "run.json").write_text(json.dumps(record))
    lines = [
        {
            "step": s,
            "t": now - 2.0 * (steps[-1] - s),
            "values": {"train/loss": 6 - s / 10, "train/tokens_per_s": 1234.4},
        }
        for s in steps
    ]
    (run / "history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if launch is not None:
        first = {"run_name": name, "status": "stopped", "steps": 20, "restarts": 0, "launch_id": "L1"}
        (run / "run_summary.json").write_text(json.dumps({**launch, "launches": [first, launch]}))
    return run


def test_a_finished_run_is_summarized_from_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    error = "rank 1 failed at step 31: ValueError: boom\n" + "".join(f"  frame {i}\n" for i in range(9))
    launch = {
        "run_name": "alpha",
        "status": "finished",
        "steps": 100,
        "restarts": 1,
        "final_loss": 1.23456,
        "tokens_per_s": 999.0,
        "resumed_from": [20, 30],
        "failures": [error],
        "error": None,
        "startup_s": {"ray": 2.5, "place": 0.5, "start": 6.0},
        "launch_id": "L2",
    }
    run = _run_dir(tmp_path / "runs", "alpha", launch=launch, steps=list(range(21, 101)), now=time.time())
    assert main(["status", "alpha", "--runs-root", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:6] == [
        "run alpha: finished (Ray; read from files)",
        "  step:        100/100",
        "  loss:        1.2346",
        "  tokens/s:    1,234",
        "  restarts:    1; resumed from step 20, 30",
        "  start-up:    9.0s (ray 2.5s, place 0.5s, start 6.0s)",
    ]
    assert "  last failure: rank 1 failed at step 31: ValueError: boom" in lines
    assert "ETA" not in "\n".join(lines)  # an ended run has none
    assert f"  checkpoints: {run / 'checkpoints'} (latest commit: step 20)" in lines
    assert f"  summary:     {run / 'run_summary.json'}" in lines
    assert f"  mlflow:      mlflow ui --backend-store-uri sqlite:///{run}/mlflow.db" in lines

    assert main(["status", "alpha", "--runs-root", str(tmp_path / "runs"), "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["final_loss"] == 1.23456 and len(raw["launches"]) == 2


def test_a_run_in_progress_has_an_eta_and_a_failed_one_its_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    now = time.time()
    # No end recorded yet (a torchrun run in progress, say): step and loss from the history, and the ETA
    # from its step rate, 2 s per step with 60 steps to go.
    starting = {"run_name": "beta", "status": "starting", "steps": 0, "restarts": 0, "launch_id": "L2"}
    _run_dir(tmp_path / "runs", "beta", launch=starting, steps=list(range(1, 41)), now=now)
    assert main(["status", "beta", "--runs-root", str(tmp_path / "runs")]) == 1  # no coordinator answers
    out = capsys.readouterr().out
    assert "run beta: started (Ray; read from files)" in out
    assert "  step:        40/100" in out and "  loss:        2.0000" in out
    assert "  ETA:         2m00s" in out
    assert "no end recorded and no live coordinator reachable" in out

    error = "rank 1 failed at step 31: ValueError: boom\n" + "".join(f"  frame {i}\n" for i in range(9))
    failed = {**starting, "status": "failed", "steps": 31, "error": error, "failures": [error]}
    _run_dir(tmp_path / "runs", "gamma", launch=failed, steps=list(range(1, 32)), now=now)
    assert main(["status", "gamma", "--runs-root", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "  error:       rank 1 failed at step 31: ValueError: boom\n" in out
    assert "... (6 more lines: d9d status --json)" in out and "frame 5" not in out
    assert "last failure" not in out  # the same as the error


def test_a_live_run_is_summarized_from_its_coordinator(tmp_path: Path) -> None:
    now = time.time()
    run = _run_dir(tmp_path, "delta", launch=None, steps=list(range(1, 11)), now=now)
    status = JobStatus(
        run_name="delta",
        state=JobState.RUNNING,
        step=10,
        total_steps=100,
        attempt=1,
        world_size=4,
        data_parallel=2,
        restarts=1,
        latest_checkpoint_step=5,
        last_loss=5.0,
        last_failure="rank 3 died",
        failures=1,
    )
    lines = format_overview(overview_from_status(status, run, None, "10.0.0.1:6379", now=now))
    assert lines[0] == "run delta: running (Ray; read from its coordinator at 10.0.0.1:6379)"
    assert "  step:        10/100" in lines and "  ETA:         3m00s" in lines
    assert "  ranks:       4 (attempt 1, dp 2)" in lines and "  last failure: rank 3 died" in lines


def test_a_closed_pipe_is_no_error(tmp_path: Path) -> None:
    """`d9d status RUN | head`: the reader is gone before the first write; nothing on stderr."""
    now = time.time()
    launch = {"run_name": "eps", "status": "finished", "steps": 100, "restarts": 0, "launch_id": "L2"}
    _run_dir(tmp_path / "runs", "eps", launch=launch, steps=list(range(1, 101)), now=now)
    for extra in ([], ["--json"]):
        read, write = os.pipe()
        os.close(read)
        done = subprocess.run(
            [sys.executable, "-m", "d9d.cli.main", "status", "eps", *extra],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
        os.close(write)
        assert done.returncode == 0 and done.stderr == "", done.stderr
