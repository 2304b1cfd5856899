"""The `log` and `null` trackers, tracker configs and the builder."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from d9d.tracking import (
    LogTracker,
    LogTrackerConfig,
    MlflowTrackerConfig,
    NullTracker,
    NullTrackerConfig,
    RunSpec,
    Tracker,
    TrackerConfig,
    build_tracker,
    flatten_params,
    histogram_summary,
)

_RUN = RunSpec(
    "demo", params={"optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "steps": 10}, tags={"who": "test"}
)


def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_tracker_writes_lines_and_json_records(tmp_path: Path) -> None:
    stream = io.StringIO()
    tracker = LogTracker(tmp_path / "m.jsonl", stream, histogram_bins=8)
    tracker.open(_RUN)
    tracker.log_scalars(1, {"loss": 2.5, "lr": 1e-4})
    values = np.random.default_rng(0).normal(size=1000)
    tracker.log_histogram(1, "grad", values)
    tracker.close()

    records = _records(tmp_path / "m.jsonl")
    assert [r["event"] for r in records] == ["open", "scalars", "histogram", "close"]
    assert records[0]["params"] == {"optim.lr": 1e-3, "optim.betas": [0.9, 0.95], "steps": 10}
    assert records[0]["tags"] == {"who": "test"}
    assert records[1]["step"] == 1 and records[1]["values"] == {"loss": 2.5, "lr": 1e-4}
    counts, edges = np.histogram(values, bins=8)
    assert records[2]["counts"] == counts.tolist()
    np.testing.assert_allclose(records[2]["edges"], edges)  # type: ignore[arg-type]
    stats = records[2]["stats"]
    assert isinstance(stats, dict)
    np.testing.assert_allclose(stats["mean"], values.mean())
    np.testing.assert_allclose(stats["p95"], np.percentile(values, 95))
    assert records[3]["status"] == "finished"

    lines = stream.getvalue().splitlines()
    assert lines[0] == "[d9d] run 'demo' opened"
    assert lines[1] == "[d9d] step 1 | loss 2.5 | lr 0.0001"
    assert lines[2].startswith("[d9d] step 1 | grad count=1000 mean=")


def test_log_tracker_resume_appends_and_skips_logged_steps(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    first = LogTracker(path, None)
    first.open(_RUN)
    for step in range(1, 8):
        first.log_scalars(step, {"loss": float(step)})
    state = json.loads(json.dumps(first.resume_state()))  # it must survive a checkpoint as JSON
    # The job dies without closing; a restart resumes from a checkpoint at step 4.
    second = LogTracker(path, io.StringIO())
    second.open(_RUN, resume=state)
    for step in range(5, 11):
        second.log_scalars(step, {"loss": 100.0 + step})
    second.close()
    steps = [(r["step"], r["values"]) for r in _records(path) if r["event"] == "scalars"]
    assert steps == [(s, {"loss": float(s)}) for s in range(1, 8)] + [
        (s, {"loss": 100.0 + s}) for s in range(8, 11)
    ]
    # A fresh (non-resumed) run starts the file anew.
    third = LogTracker(path, None)
    third.open(_RUN)
    third.log_scalars(1, {"loss": 0.0})
    third.close()
    assert [r["event"] for r in _records(path)] == ["open", "scalars", "close"]


def test_log_tracker_refuses_misuse(tmp_path: Path) -> None:
    tracker = LogTracker(tmp_path / "m.jsonl", None)
    with pytest.raises(RuntimeError, match="call open"):
        tracker.log_scalars(0, {"x": 1.0})
    with pytest.raises(ValueError, match="cannot resume a 'mlflow' tracker run with the 'log' tracker"):
        tracker.open(_RUN, resume={"kind": "mlflow", "run_id": "abc"})
    tracker.open(_RUN)
    with pytest.raises(RuntimeError, match="'demo' is already open"):
        tracker.open(_RUN)
    tracker.close()


def test_configs_parse_by_kind_and_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    adapter: TypeAdapter[TrackerConfig] = TypeAdapter(TrackerConfig)
    log_cfg = adapter.validate_python({"kind": "log", "jsonl": "sub/metrics.jsonl"})
    assert isinstance(log_cfg, LogTrackerConfig)
    tracker = build_tracker(log_cfg, tmp_path)
    tracker.open(RunSpec("r"))
    tracker.log_scalars(3, {"a": 1.0})
    tracker.close()
    assert (tmp_path / "sub" / "metrics.jsonl").exists()
    assert "[d9d] step 3 | a 1" in capsys.readouterr().out

    silent = build_tracker(LogTrackerConfig(stdout=False, jsonl=None), tmp_path)
    silent.open(RunSpec("quiet"))
    silent.log_scalars(1, {"a": 1.0})
    silent.close()
    assert capsys.readouterr().out == ""

    assert isinstance(build_tracker(adapter.validate_python({"kind": "null"}), tmp_path), NullTracker)
    assert isinstance(adapter.validate_python({"kind": "mlflow"}), MlflowTrackerConfig)
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        adapter.validate_python({"kind": "aim"})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        adapter.validate_python({"kind": "log", "colour": True})
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        LogTrackerConfig(histogram_bins=0)


def test_every_tracker_satisfies_the_protocol(tmp_path: Path) -> None:
    null = NullTracker()
    for tracker in (null, LogTracker(tmp_path / "x.jsonl", None)):
        assert isinstance(tracker, Tracker)
    null.open(_RUN)
    null.log_scalars(1, {"a": 1.0})
    null.log_histogram(1, "h", [1.0])
    assert null.resume_state() == {"kind": "null"}
    null.close()
    assert isinstance(build_tracker(NullTrackerConfig(), tmp_path), Tracker)


def test_helpers() -> None:
    assert flatten_params({"a": {"b": {"c": 1}}, "d": "x"}) == {"a.b.c": 1, "d": "x"}
    assert histogram_summary([]) == {"count": 0.0}
    stats = histogram_summary(np.arange(101.0))
    assert stats["p05"] == 5.0 and stats["p50"] == 50.0 and stats["max"] == 100.0
    np.testing.assert_allclose(stats["std"], np.arange(101.0).std())


def test_trackers_never_import_torch(tmp_path: Path) -> None:
    """The coordinator may be a process without torch.distributed: building and using trackers
    (including MLflow's) must not pull torch in."""
    code = f"""
import sys
from d9d.tracking import LogTrackerConfig, MlflowTrackerConfig, RunSpec, build_tracker
for cfg in (LogTrackerConfig(stdout=False), MlflowTrackerConfig()):
    t = build_tracker(cfg, {str(tmp_path)!r})
    t.open(RunSpec("x", {{"a": 1}}))
    t.log_scalars(1, {{"l": 1.0}})
    t.log_histogram(1, "h", [1.0, 2.0])
    t.close()
assert "torch" not in sys.modules, "torch was imported"
"""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=repo, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "mlflow.db").exists()
