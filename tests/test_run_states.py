"""The state `d9d list` and `d9d status` show for a run that no launcher recorded the end of: a script that
drove the `Trainer` itself (now `recorded_train`: running, then finished, stopped or failed), a process
that is gone without recording its end (`died`), and a directory with no `run.json` at all (`finished`
when its newest commit is its last step, else `no record`), never `unknown`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from d9d.cli.main import main
from d9d.cluster.registry import find_record, records, state_from_files
from d9d.engine.config import parse_config
from d9d.engine.launch import recorded_train
from d9d.engine.runtime import RankResult
from tests.cluster_fixtures import toy_job


def _commit(run: Path, step: int, total_steps: int) -> None:
    step_dir = run / "checkpoints" / f"step-{step:08d}"
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text("{}")
    (step_dir / "train_config.json").write_text(json.dumps({"trainer": {"total_steps": total_steps}}))
    (run / "checkpoints" / "latest").write_text(step_dir.name)


def _history(run: Path, steps: range) -> None:
    lines = [{"step": s, "t": time.time(), "values": {"train/loss": 5.0 - s / 10}} for s in steps]
    (run / "history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def _listed(runs: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, list[str]]:
    assert main(["list", "--runs-root", str(runs)]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    return {row.split()[0]: row.split() for row in rows}


def test_a_run_directory_without_records_shows_what_its_files_tell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script that trained with the `Trainer` and its own `LocalRunReporter` left checkpoints (and,
    with a tracker, a history), no run.json nor run_summary.json: `d9d list` said `unknown`."""
    runs = tmp_path / "runs"
    _commit(runs / "done", 10, 20)
    _commit(runs / "done", 20, 20)  # the last step is committed: it finished
    _commit(runs / "partway", 8, 20)
    _history(runs / "partway", range(1, 12))  # trained past its newest commit
    (runs / "history-only").mkdir(parents=True)
    _history(runs / "history-only", range(1, 6))

    listed = _listed(runs, capsys)
    assert listed["done"][1:3] == ["finished", "20"]
    assert listed["partway"][1:5] == ["no", "record", "11", "3.9"]
    assert listed["history-only"][1:4] == ["no", "record", "5"]
    assert all(row[-3] == "unknown" for row in listed.values())  # the launcher: it left no run.json

    assert main(["status", "done", "--runs-root", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "run done: finished (no run.json; read from files)" in out and "  step:        20/20" in out
    main(["status", "partway", "--runs-root", str(runs)])
    out = capsys.readouterr().out
    assert "run partway: no record (no run.json; read from files)" in out and "  step:        11/20" in out


def _record(run: Path, driver: str, started_at: float) -> None:
    run.mkdir(parents=True)
    record = {
        "run_name": run.name,
        "run_dir": str(run),
        "launch_id": "L1",
        "started_at": started_at,
        "driver": driver,
        "launcher": "script",
        "total_steps": 20,
    }
    (run / "run.json").write_text(json.dumps(record))
    start = {"run_name": run.name, "status": "starting", "steps": 0, "restarts": 0, "launch_id": "L1"}
    (run / "run_summary.json").write_text(json.dumps({**start, "launches": [start]}))


def test_a_launch_without_an_end_is_running_while_its_process_lives(tmp_path: Path) -> None:
    """A launch without Ray that recorded its start but not (yet) its end: `running` while the process
    named in run.json lives on this host, `died` once it is gone (killed before it could record the end),
    `started` when it ran on another host."""
    runs = tmp_path / "runs"
    host = socket.gethostname()
    _record(runs / "alive", f"{host}:{os.getpid()}", time.time())
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    _record(runs / "gone", f"{host}:{int(gone.stdout)}", time.time())
    _record(runs / "elsewhere", f"{host}-not:{os.getpid()}", time.time())
    # A process that reuses the pid later is not the launch's.
    _record(runs / "reused", f"{host}:{os.getpid()}", time.time() - 3600 * 24 * 365)

    states = {r.run_name: state_from_files(r).state for r in records(runs)}
    assert states == {"alive": "running", "gone": "died", "elsewhere": "started", "reused": "died"}


def _trainer(tmp_path: Path, train: object) -> SimpleNamespace:
    job = toy_job("scripted", tmp_path / "run", steps=20)
    del job["cluster"]
    return SimpleNamespace(
        config=parse_config(job, check_components=False), progress=SimpleNamespace(step=0), train=train
    )


def test_a_script_that_records_its_training_shows_how_it_ended(tmp_path: Path) -> None:
    def finished() -> RankResult:
        record = find_record("scripted", run_dir=tmp_path / "run")
        assert record is not None and state_from_files(record).state == "running"  # while it trains
        return RankResult(status="finished", steps=20, final_loss=0.5, tokens_per_s=None)

    result = recorded_train(_trainer(tmp_path, finished))  # type: ignore[arg-type]
    assert result.status == "finished"
    record = find_record("scripted", run_dir=tmp_path / "run")
    assert record is not None and record.launcher == "script" and record.total_steps == 20
    state = state_from_files(record)
    assert (state.state, state.step, state.last_loss) == ("finished", 20, 0.5)

    def fails() -> RankResult:
        raise RuntimeError("boom at step 3")

    with pytest.raises(RuntimeError):
        recorded_train(_trainer(tmp_path, fails))  # type: ignore[arg-type]
    record = find_record("scripted", run_dir=tmp_path / "run")
    assert record is not None and state_from_files(record).state == "failed"
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["error"] == "RuntimeError: boom at step 3" and len(summary["launches"]) == 2
