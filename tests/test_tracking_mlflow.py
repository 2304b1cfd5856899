"""The MLflow tracker, read back through `MlflowClient`: a shared SQLite store, and a real `mlflow server`."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow import MlflowClient  # imported after the telemetry switch

from d9d.tracking import MlflowTrackerConfig, RunSpec, Tracker, build_tracker
from d9d.tracking.mlflow_tracker import MlflowTracker

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

_PARAMS = {"model": {"layers": 2, "hidden": 64}, "optim": {"lr": 3e-4}, "seed": 7}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One store for the module: creating a SQLite store runs MLflow's migrations (seconds)."""
    return tmp_path_factory.mktemp("mlflow-run")


@pytest.fixture(scope="module")
def store_uri(run_dir: Path) -> str:
    return f"sqlite:///{run_dir / 'mlflow.db'}"


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_default_store_round_trip(run_dir: Path, store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = build_tracker(MlflowTrackerConfig(experiment="roundtrip"), run_dir)
    assert isinstance(tracker, MlflowTracker) and isinstance(tracker, Tracker)
    assert tracker.tracking_uri == store_uri.replace(str(run_dir), str(run_dir.resolve()))
    tracker.open(RunSpec("first", params=_PARAMS, tags={"team": "d9d"}))
    run_id = tracker.resume_state()["run_id"]
    for step in range(1, 6):
        tracker.log_scalars(step, {"loss": 1.0 / step, "lr": 1e-4 * step})
    grads = np.random.default_rng(1).normal(size=500)
    tracker.log_histogram(5, "grad_norm", grads)
    tracker.close()

    client = MlflowClient(tracking_uri=store_uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "first"
    assert run.info.status == "FINISHED"
    assert run.data.tags["team"] == "d9d"
    assert run.data.params == {"model.layers": "2", "model.hidden": "64", "optim.lr": "0.0003", "seed": "7"}
    assert _history(client, run_id, "loss") == [(s, 1.0 / s) for s in range(1, 6)]
    np.testing.assert_allclose(
        [v for _, v in _history(client, run_id, "lr")], [1e-4 * s for s in range(1, 6)]
    )
    assert _history(client, run_id, "grad_norm/count") == [(5, 500.0)]
    np.testing.assert_allclose(client.get_metric_history(run_id, "grad_norm/mean")[0].value, grads.mean())
    np.testing.assert_allclose(
        client.get_metric_history(run_id, "grad_norm/p75")[0].value, np.percentile(grads, 75)
    )
    # The store and the artifacts live in the run directory.
    assert (run_dir / "mlflow.db").exists()
    assert run.info.artifact_uri.startswith((run_dir.resolve() / "mlartifacts").as_uri())


def test_resume_continues_the_run_without_duplicate_steps(
    store_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = MlflowTrackerConfig(tracking_uri=store_uri, experiment="resume")
    first = build_tracker(config, "/nonexistent-unused")
    first.open(RunSpec("job", params=_PARAMS))
    for step in range(1, 11):
        first.log_scalars(step, {"loss": float(step)})
        if step == 6:
            checkpoint_state = first.resume_state()  # saved with the step-6 checkpoint
    # The job dies at step 10 without closing; the restart resumes from the step-6 checkpoint.
    second = build_tracker(config, "/nonexistent-unused")
    changed = {**_PARAMS, "seed": 8, "extra": "new"}
    with caplog.at_level(logging.WARNING, logger="d9d.tracking.mlflow_tracker"):
        second.open(RunSpec("job", params=changed), resume=checkpoint_state)
    assert "keeps its old values of ['seed']" in caplog.text
    for step in range(7, 15):
        second.log_scalars(step, {"loss": 100.0 + step})
        second.log_histogram(step, "w", [float(step)])
    assert second.resume_state()["run_id"] == checkpoint_state["run_id"]
    second.close("failed")

    client = MlflowClient(tracking_uri=store_uri)
    run_id = checkpoint_state["run_id"]
    # Every step exactly once; steps 7..10 keep the values the first attempt logged.
    assert _history(client, run_id, "loss") == [(s, float(s)) for s in range(1, 11)] + [
        (s, 100.0 + s) for s in range(11, 15)
    ]
    assert [s for s, _ in _history(client, run_id, "w/mean")] == list(range(11, 15))
    experiment = client.get_experiment_by_name("resume")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    assert runs[0].info.status == "FAILED"
    assert runs[0].data.params["seed"] == "7" and runs[0].data.params["extra"] == "new"


def test_tracking_uri_from_environment(
    tmp_path: Path, store_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    tracker = build_tracker(MlflowTrackerConfig(experiment="from-env"), tmp_path / "elsewhere")
    tracker.open(RunSpec("env"))
    tracker.log_scalars(1, {"x": 2.0})
    tracker.close()
    assert not (tmp_path / "elsewhere").exists()  # nothing created in the run dir: the env store was used
    client = MlflowClient(tracking_uri=store_uri)
    assert _history(client, _only_run(client, "from-env"), "x") == [(1, 2.0)]


def _only_run(client: MlflowClient, experiment: str) -> str:
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    (run,) = client.search_runs([found.experiment_id])
    return str(run.info.run_id)


def test_resume_errors_name_the_problem(store_uri: str) -> None:
    tracker = build_tracker(MlflowTrackerConfig(tracking_uri=store_uri), "/unused")
    with pytest.raises(RuntimeError, match="cannot resume run 0123abcd at sqlite"):
        tracker.open(RunSpec("x"), resume={"kind": "mlflow", "run_id": "0123abcd"})
    with pytest.raises(ValueError, match="cannot resume a 'log' tracker run with the 'mlflow' tracker"):
        tracker.open(RunSpec("x"), resume={"kind": "log", "path": "m.jsonl"})
    with pytest.raises(RuntimeError, match="call open"):
        tracker.log_scalars(1, {"a": 1.0})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
        "--default-artifact-root", str(root / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.25)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn worker, started above
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.slow
def test_against_a_real_mlflow_server(server_uri: str) -> None:
    config = MlflowTrackerConfig(tracking_uri=server_uri, experiment="served")
    tracker = build_tracker(config, "/unused")
    tracker.open(RunSpec("remote", params=_PARAMS))
    for step in (1, 2, 3):
        tracker.log_scalars(step, {"loss": float(step)})
    state = tracker.resume_state()
    resumed = build_tracker(config, "/unused")
    resumed.open(RunSpec("remote", params=_PARAMS), resume=state)
    for step in (2, 3, 4):
        resumed.log_scalars(step, {"loss": 10.0 * step})
    resumed.close()

    client = MlflowClient(tracking_uri=server_uri)
    run = client.get_run(state["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.0003"
    assert _history(client, state["run_id"], "loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
