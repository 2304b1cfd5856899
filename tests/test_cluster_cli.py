"""The `d9d` cluster commands as a user runs them: the demo (`d9d train` of the tiny Qwen3-MoE example on 4
rank actors of an embedded local Ray instance, metrics read back from the MLflow store), config errors
before Ray starts, and on one real `ray start --head` cluster started by the test (non-default ports):
submit/status/logs/stop, a detached run followed from a `ray://` client after its driver exited, a plugin
package reaching the ranks through the runtime env, and runs found by name (`run.json`, the named
coordinator; `d9d status/logs/stop/list`) whether started detached or by `ray job submit`. The runtime env
checks that need no cluster are in tests/test_cluster_runs.py."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from d9d.cluster.control.startup import LABELS, PHASES
from tests.cluster_fixtures import reference_losses, toy_job

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Ray >= 2.5x clusters authenticate with a token; these tests bring their own rather than rely on ~/.ray.
TOKEN = secrets.token_hex(32)


def _env(**extra: str) -> dict[str, str]:
    # "python" inside a Ray job must be this interpreter; rank actors import tests.* from the repo.
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", PYTHONPATH=str(REPO))
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    return env


def _d9d(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "d9d.cli.main", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _write(path: Path, job: dict) -> Path:
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.parametrize(
    ("section", "value", "message"),
    [
        ("mesh", {"data_parallel_shard": 2, "expert_parallel": 3}, "expert_parallel=3 must divide"),
        ("trainer", {"total_steps": 5, "epochs": 2}, "trainer.epochs"),
    ],
)
def test_train_reports_config_errors_before_starting_ray(
    tmp_path: Path, section: str, value: dict, message: str
) -> None:
    job = toy_job("bad", tmp_path / "run")
    job[section] = value
    out = _d9d("train", str(_write(tmp_path / "job.yaml", job)), cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Ray" not in out.stdout + out.stderr  # no local instance was started, no actor exists
    assert not (tmp_path / "run").exists()


def test_demo_trains_tiny_qwen3_moe_on_four_rank_actors_into_mlflow(tmp_path: Path) -> None:
    """`d9d demo` = `d9d train examples/qwen3_moe_pretrain/tiny.yaml --cpu`: 4 ranks, HSDP 2×2 × EP 2."""
    steps, run_dir = 5, tmp_path / "run"
    sets = [f"trainer.total_steps={steps}", "logging.period=1", f"run.dir={run_dir}"]
    out = _d9d("demo", *[a for s in sets for a in ("--set", s)], cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[d9d] run tiny-qwen3-moe: running (attempt 0, 4 ranks, dp 4)" in out.stdout
    assert f"[d9d] run tiny-qwen3-moe finished: {steps}/{steps} steps" in out.stdout
    # The start-up, phase by phase as each ended, then in one line; the same in the summary.
    said = [line.removeprefix("[d9d] start-up: ") for line in out.stdout.splitlines() if "start-up: " in line]
    labels = [LABELS[p] for p in PHASES if p != "tracker"]  # the tracker was ready before the ranks, or not
    assert [s.rsplit(" ", 1)[0] for s in said if not s.startswith("tracker")] == labels, said
    (started,) = [line for line in out.stdout.splitlines() if line.startswith("[d9d] started in ")]
    first_step = out.stdout.index("[d9d] step 1/")
    assert out.stdout.index(said[0]) < out.stdout.index(started) < first_step
    # The ranks' own output is in their log files, not on the console; the end says where to look.
    assert "RankActor" not in out.stdout + out.stderr
    assert f"mlflow ui --backend-store-uri sqlite:///{run_dir.resolve()}/mlflow.db" in out.stdout
    assert all((run_dir / "logs" / f"rank{r}.log").is_file() for r in range(4))

    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == steps and summary["restarts"] == 0
    startup = summary["startup_s"]
    assert set(PHASES) - set(startup) <= {"tracker"} and all(v >= 0 for v in startup.values())
    assert f"started in {sum(startup.values()):.1f}s" in started  # what the console said
    assert 1.0 < sum(startup.values()) < 600 and startup["launch"] > 0.1  # counted from the process start
    status = _d9d("status", "tiny-qwen3-moe", "--run-dir", str(run_dir), cwd=REPO)
    assert f"start-up:    {sum(startup.values()):.1f}s (launch " in status.stdout, status.stdout
    assert summary["recovery_times_s"] == [] and summary["tokens_per_s"] > 0
    assert summary["final_loss"] < summary["losses"]["1"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{steps:08d}"

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("d9d").experiment_id])
    assert [r.info.run_name for r in runs] == ["tiny-qwen3-moe"]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["config.trainer.total_steps"] == str(steps)
    assert run.data.params["cluster.num_workers"] == "4"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history == {int(k): v for k, v in summary["losses"].items()}
    assert sorted(history) == list(range(1, steps + 1))
    for rank in range(4):
        assert len(client.get_metric_history(run.info.run_id, f"system/rank{rank}/step_time_s")) == steps
    assert client.get_metric_history(run.info.run_id, "system/cluster/world_size")[0].value == 4
    # The tracker lag is recorded (its size is a timing: benchmarks/cluster_overhead.py reports it).
    assert client.get_metric_history(run.info.run_id, "system/cluster/metrics_lag_s")


def test_piped_console_is_plain_text(tmp_path: Path) -> None:
    """`d9d train ... | tee log`: what Ray forwards from the actors (`--verbose`: the ranks' own output) comes
    without the colour codes Ray puts on its prefixes on a terminal."""
    job = toy_job(
        "plain",
        tmp_path / "run",
        steps=3,
        cluster={"entrypoint": "tests.test_console_plots:printing_run_rank"},
    )
    out = _d9d("train", str(_write(tmp_path / "job.yaml", job)), "--verbose", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout + out.stderr
    assert "hello from rank 1" in console and "(RankActor pid=" in console  # forwarded by Ray
    assert "\x1b[" not in console
    assert "[d9d] run plain finished: 3/3 steps" in out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class Head:
    gcs: str  # for Ray drivers (d9d train --address, ray.init)
    dashboard: str  # for the Jobs API (d9d submit/status/logs/stop)
    client: str  # for Ray clients (ray://), e.g. a notebook outside the cluster


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    """A real single-node Ray cluster (`ray start --head --block`), stopped by its own process id."""
    tmp_path = tmp_path_factory.mktemp("head")
    dashboard, gcs, client = _free_port(), _free_port(), _free_port()
    ports = [f"--port={gcs}", f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}"]
    ports += [f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}"]
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", *ports, "--num-cpus=3", "--block", "--disable-usage-stats"],
        env=_env(RAY_JOB_STOP_WAIT_TIME_S="20"),
        stdout=(tmp_path / "head.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while _d9d("status", "nothing", "--address", address, cwd=tmp_path).stderr.count("no Ray job") == 0:
            assert head.poll() is None, (tmp_path / "head.log").read_text()
            assert time.monotonic() < deadline, "the Ray head's dashboard never came up"
            time.sleep(1)
        yield Head(gcs=f"127.0.0.1:{gcs}", dashboard=address, client=f"ray://127.0.0.1:{client}")
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops everything it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def test_submit_status_logs_stop(ray_head: Head, tmp_path: Path) -> None:
    address = ray_head.dashboard
    work = tmp_path / "work"
    work.mkdir()
    run_dir = tmp_path / "run"
    job = toy_job("submitted", run_dir, steps=100_000, model={"options": {"step_sleep_s": 0.05}})
    _write(work / "job.yaml", job)

    out = _d9d("submit", "job.yaml", "--address", address, "--working-dir", str(work), cwd=work)
    assert out.returncode == 0, out.stderr
    submission = out.stdout.strip()
    assert submission.startswith("d9d-submitted-")

    deadline = time.monotonic() + 180
    while True:
        status = _d9d("status", "submitted", "--address", address, cwd=work).stdout
        if "last: [d9d] step" in status:
            break
        assert "FAILED" not in status, _d9d("logs", "submitted", "--address", address, cwd=work).stdout
        assert time.monotonic() < deadline, status
        time.sleep(1)
    assert f"Ray job {submission} RUNNING" in status
    assert "submitted/coordinator: ALIVE" in status
    assert "submitted/rank-0: ALIVE" in status and "submitted/rank-1: ALIVE" in status

    logs = _d9d("logs", "submitted", "--address", address, cwd=work).stdout
    assert "[d9d] run submitted: running" in logs

    stopped = _d9d("stop", "submitted", "--address", address, cwd=work)
    assert stopped.returncode == 0 and "STOPPED" in stopped.stdout
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "stopped" and 0 < summary["steps"] < 100_000
    final = _d9d("status", "submitted", "--address", address, cwd=work).stdout
    assert "STOPPED" in final and "ALIVE" not in final


def test_status_of_a_submitted_run_that_finished_shows_its_end(ray_head: Head, tmp_path: Path) -> None:
    """The last progress line of a finished Ray job is the run's end, not the lines after it that say
    where its files are (`last: [d9d]   rank logs: ...`)."""
    address = ray_head.dashboard
    work = tmp_path / "work"
    work.mkdir()
    _write(work / "job.yaml", toy_job("short", tmp_path / "run", steps=3))
    out = _d9d("submit", "job.yaml", "--address", address, "--working-dir", str(work), cwd=work)
    assert out.returncode == 0, out.stderr
    status = _wait_for(
        lambda: _d9d("status", "short", "--address", address, cwd=work).stdout,
        " SUCCEEDED",
        "the submitted run never finished",
    )
    assert "last: [d9d] run short finished: 3/3 steps" in status, status


_ATTACH = """
import sys
from d9d.cluster import TrainingJob, connect
connect(sys.argv[1])
job = TrainingJob.attach("detached")
summary = job.result(timeout=180)
job.close()  # a finished detached coordinator would otherwise linger for cluster.linger_s
print(summary.status, summary.steps)
"""


def test_detached_run_outlives_its_driver(ray_head: Head, tmp_path: Path) -> None:
    job = toy_job("detached", tmp_path / "run", steps=15, model={"options": {"step_sleep_s": 0.2}})
    config = _write(tmp_path / "job.yaml", job)
    out = _d9d("train", str(config), "--detach", "--address", ray_head.gcs, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "run detached started (detached)" in out.stdout  # and that driver process has exited

    # A Ray client (a notebook outside the cluster) finds the run by name and waits for its end. On a
    # loaded machine Ray's client proxy sometimes fails to start its per-client server in time: retry that.
    for _ in range(3):
        attach = subprocess.run(
            [sys.executable, "-c", _ATTACH, ray_head.client],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=240,
        )
        if "Starting Ray client server failed" not in attach.stderr:
            break
    assert attach.returncode == 0, attach.stderr[-3000:]
    assert attach.stdout.split()[-2:] == ["finished", "15"]
    assert json.loads((tmp_path / "run" / "run_summary.json").read_text())["status"] == "finished"


_NOTEBOOK = """
import sys
import ray  # imported first, as a notebook's earlier cell did, with RAY_AUTH_MODE unset
from d9d.cluster import connect
connect(sys.argv[1])
print("joined", ray.is_initialized())
"""


def test_a_notebook_that_imported_ray_first_joins_by_the_ray_client_with_its_token(
    ray_head: Head, tmp_path: Path
) -> None:
    """Ray reads RAY_AUTH_MODE at import; without it a Ray client sends no token, and the head's client
    server, which wants one, leaves it to time out ("ray client connection timeout"). `connect()` turns the
    token at hand on and has Ray read its configuration again."""
    env = {k: v for k, v in _env().items() if k != "RAY_AUTH_MODE"}  # the token is there, the mode is not
    for _ in range(
        3
    ):  # Ray's client proxy sometimes fails to start its per-client server in time: retry that
        out = subprocess.run(
            [sys.executable, "-c", _NOTEBOOK, ray_head.client],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if "Starting Ray client server failed" not in out.stderr:
            break
    assert out.returncode == 0 and out.stdout.split() == ["joined", "True"], out.stderr[-3000:]


# -- a runtime env's package on the ranks, and runs found by name, on the same head ---------------------

# Each CLI call is a fresh Python process (torch, ray imports): slow on a loaded machine.
_MANY_CLI_CALLS = pytest.mark.timeout(600)

PKG = "d9d_runtime_env_plugin"
# The run's rank entrypoint lives only in a package directory made by the test: not installed, not on
# the PYTHONPATH of the driver or of the cluster's workers. It notes where each rank imported it from.
_PLUGIN = """
from pathlib import Path

from tests.cluster_fixtures import toy_run_rank


def run_rank(config, runtime, reporter):
    Path(config["run"]["dir"], f"imported-by-rank{runtime.rank}").write_text(__file__)
    return toy_run_rank(config, runtime, reporter)
"""


def _plugin(root: Path) -> Path:
    package = root / "plugins" / PKG
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(_PLUGIN)
    return package


def _plugin_job(name: str, run_dir: Path, package: Path | None, **sections: Any) -> dict[str, Any]:
    job = toy_job(name, run_dir, **sections)
    job["cluster"] = {**job["cluster"], "entrypoint": f"{PKG}:run_rank"}
    if package is not None:
        job["cluster"]["runtime_env"] = {"py_modules": [str(package)], "env_vars": {"D9D_TEST_ENV": "1"}}
    return job


_DRIVER = """
import json, sys
from d9d.cluster import TrainingJob
job = TrainingJob(json.loads(sys.argv[2])).start(address=sys.argv[1])
summary = job.result(timeout=240)
print(summary.status, summary.steps)
"""


@_MANY_CLI_CALLS
def test_a_plugin_package_reaches_the_ranks_through_the_runtime_env(ray_head: Head, tmp_path: Path) -> None:
    package = _plugin(tmp_path)
    runs = tmp_path / "runs"
    job = _plugin_job("plugged", runs / "plugged", package, steps=4)
    out = subprocess.run(
        [sys.executable, "-c", _DRIVER, ray_head.gcs, json.dumps(job)],
        cwd=tmp_path,
        env=_env(),  # PYTHONPATH is the repository only: the package is not importable by itself
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["finished", "4"]
    for rank in range(2):
        imported = (runs / "plugged" / f"imported-by-rank{rank}").read_text()
        assert imported.endswith(f"{PKG}/__init__.py") and not imported.startswith(str(tmp_path))
    summary = json.loads((runs / "plugged" / "run_summary.json").read_text())
    assert [summary["losses"][str(s)] for s in range(1, 5)] == reference_losses(job, 2)

    # The run registered itself: found by name once it ended, with Ray gone from the picture.
    record = json.loads((runs / "plugged" / "run.json").read_text())
    # The head's address as Ray names it (its node IP, not the loopback the driver joined through).
    assert record["run_name"] == "plugged" and record["ray_address"].endswith(ray_head.gcs.rpartition(":")[2])
    listed = _d9d("list", "--runs-root", str(runs), cwd=tmp_path).stdout.splitlines()
    row = next(line.split() for line in listed if line.startswith("plugged "))
    assert row[:6] == ["plugged", "finished", "4", f"{summary['final_loss']:.6g}", "ray", "files"]
    status = _d9d(
        "status",
        "plugged",
        "--runs-root",
        str(runs),
        "--address",
        "http://127.0.0.1:1",
        "--json",
        cwd=tmp_path,
    )
    assert status.returncode == 0 and json.loads(status.stdout)["status"] == "finished"


def _wait_for(command: Any, needle: str, what: str, timeout_s: float = 180) -> str:
    """`command()`'s output once it contains `needle`."""
    deadline = time.monotonic() + timeout_s
    while True:
        output = str(command())
        if needle in output:
            return output
        assert time.monotonic() < deadline, f"{what}: {output}"
        time.sleep(1)


@_MANY_CLI_CALLS
def test_a_ray_job_submit_run_is_found_through_its_coordinator(ray_head: Head, tmp_path: Path) -> None:
    """`ray job submit -- d9d train`: no d9d metadata on the job; found through the Ray job that created
    the run's coordinator."""
    runs = tmp_path / "runs"
    slow: dict[str, Any] = {"model": {"options": {"step_sleep_s": 0.1}}}
    work = tmp_path / "work"
    work.mkdir()
    _write(work / "job.yaml", toy_job("raw", runs / "raw", steps=100_000, **slow))
    submitted = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", ray_head.dashboard, "--working-dir", str(work),
         "--no-wait", "--", "python", "-m", "d9d.cli.main", "train", "job.yaml"],
        cwd=work, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    by_dashboard = ("--address", ray_head.dashboard, "--runs-root", str(tmp_path / "elsewhere"))
    status = _wait_for(
        lambda: (lambda out: out.stdout + out.stderr)(_d9d("status", "raw", *by_dashboard, cwd=work)),
        "raw/coordinator: ALIVE",
        "the ray job submit run was never found",
        timeout_s=300,
    )
    assert " RUNNING" in status
    stopped = _d9d("stop", "raw", *by_dashboard, cwd=work)
    assert stopped.returncode == 0 and "STOPPED" in stopped.stdout, stopped.stderr


@_MANY_CLI_CALLS
def test_a_detached_run_is_found_through_its_record(ray_head: Head, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    slow: dict[str, Any] = {"model": {"options": {"step_sleep_s": 0.1}}}

    # `d9d train --detach`: no Ray job of its own; the record says where the coordinator lives.
    detached = toy_job("bg", runs / "bg", steps=100_000, **slow)
    detached["cluster"] = {**detached["cluster"], "linger_s": 1}
    config = _write(tmp_path / "bg.yaml", detached)
    out = _d9d("train", str(config), "--detach", "--address", ray_head.gcs, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lookup = ("--runs-root", str(runs), "--address", "http://127.0.0.1:1")  # no dashboard: the record
    status = _wait_for(
        lambda: _d9d("status", "bg", *lookup, cwd=tmp_path).stdout,
        "run bg: running (Ray; read from its coordinator at ",
        "the detached run never reported a step",
    )
    assert "step:" in status and "/100000" in status
    # The dashboard URL alone finds it too (the state API lists its coordinator with its directory and
    # the cluster's Ray address), with no runs root that holds it.
    elsewhere = ("--runs-root", str(tmp_path / "elsewhere"), "--address", ray_head.dashboard)
    by_url = _d9d("status", "bg", *elsewhere, cwd=tmp_path)
    assert "run bg: running (Ray; read from its coordinator at " in by_url.stdout, by_url.stderr
    listed = _d9d("list", *elsewhere, cwd=tmp_path).stdout
    assert any(line.split()[:2] == ["bg", "running"] for line in listed.splitlines()), listed
    listed = _d9d("list", "--runs-root", str(runs), "--address", ray_head.gcs, cwd=tmp_path).stdout
    assert any(
        line.split()[:2] == ["bg", "running"] and "coordinator" in line for line in listed.splitlines()
    )

    stopped = _d9d("stop", "bg", *lookup, cwd=tmp_path)
    assert stopped.returncode == 0 and "run bg: stopped" in stopped.stdout, stopped.stderr
    assert json.loads((runs / "bg" / "run_summary.json").read_text())["status"] == "stopped"
    logs = _d9d("logs", "bg", *lookup, cwd=tmp_path)
    assert logs.returncode == 0 and "rank0.log" in logs.stdout


def test_status_of_a_local_run_reads_its_summary(tmp_path: Path) -> None:
    summary = {"run_name": "local", "status": "finished", "steps": 3, "restarts": 0}
    (tmp_path / "run_summary.json").write_text(json.dumps(summary))
    unreachable = f"http://127.0.0.1:{_free_port()}"  # no Ray dashboard there: fall back to the run dir
    out = _d9d(
        "status", "local", "--address", unreachable, "--run-dir", str(tmp_path), "--json", cwd=tmp_path,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == summary
    missing = _d9d(
        "status", "other", "--address", unreachable, "--run-dir", str(tmp_path / "none"), cwd=tmp_path
    )
    assert missing.returncode == 1 and "d9d status:" in missing.stderr
