"""Runtime environments (`cluster.runtime_env`, `d9d submit --runtime-env*`) and finding any run by its
name (`run.json`, the named coordinator; `d9d status/logs/stop/list`), on a `ray start --head` cluster on
non-default ports."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from d9d.cluster.reach import SUBMITTED_PATHS_ENV
from d9d.engine.config import ConfigError
from tests.cluster_fixtures import reference_losses, toy_job
from tests.test_cluster_cli import BIN, REPO, Head, _d9d, _env, _write, ray_head  # noqa: F401

# Each CLI call is a fresh Python process (torch, ray imports): slow on a loaded machine.
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

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


def test_runtime_env_is_validated_and_the_driver_checks_imports_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from d9d.cluster import build_job
    from d9d.cluster.client import preflight_job

    monkeypatch.chdir(tmp_path)
    job = _plugin_job("renv", tmp_path / "run", None)
    job["cluster"]["runtime_env"] = {"py_modules": ["plugins/missing"]}
    with pytest.raises(
        ConfigError, match=r"cluster\.runtime_env\.py_modules.*plugins/missing does not exist"
    ):
        build_job(job)

    package = _plugin(tmp_path)
    without = build_job(_plugin_job("renv", tmp_path / "run", None))
    with pytest.raises(ConfigError, match=f"cluster.entrypoint.*No module named '{PKG}'"):
        preflight_job(without)
    # A relative package path is resolved against the working directory, like run.dir.
    job = _plugin_job("renv", tmp_path / "run", None)
    job["cluster"]["runtime_env"] = {"py_modules": [f"plugins/{PKG}"]}
    spec = build_job(job)
    assert spec.cluster.runtime_env is not None
    assert spec.cluster.runtime_env.py_modules == [str(package)]
    path_before = list(sys.path)
    monkeypatch.delitem(sys.modules, PKG, raising=False)
    preflight_job(spec)  # imports the package the way the ranks will see it
    assert sys.modules[PKG].__file__ == str(package / "__init__.py")
    assert sys.path == path_before
    monkeypatch.delitem(sys.modules, PKG)


class _FakeJobs:
    submitted: ClassVar[dict[str, Any]] = {}

    def __init__(self, address: str) -> None:
        pass

    def submit_job(self, **kwargs: Any) -> str:
        type(self).submitted = kwargs
        return str(kwargs["submission_id"])


def test_submit_merges_the_command_line_runtime_env_over_the_job_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from d9d.cluster import submit as jobs
    from d9d.cluster.runtime_env import RuntimeEnvConfig

    monkeypatch.chdir(tmp_path)
    package = _plugin(tmp_path)
    job = _plugin_job("merged", tmp_path / "run", package)
    job["cluster"]["runtime_env"]["env_vars"] = {"A": "file", "B": "file"}
    config = _write(tmp_path / "job.yaml", job)
    monkeypatch.setattr(jobs, "JobSubmissionClient", _FakeJobs)
    extra = RuntimeEnvConfig(env_vars={"B": "cli"}, pip=["einops"], excludes=["*.bin"])
    jobs.submit(config, "http://head:8265", runtime_env=extra)

    sent = _FakeJobs.submitted
    # Beside the job's own variables: the submitted-paths check (d9d/cluster/reach.py); every path of this
    # job is absolute, so it pins none.
    pinned = json.loads(sent["runtime_env"]["env_vars"].pop(SUBMITTED_PATHS_ENV))
    assert pinned["paths"] == []
    assert sent["runtime_env"] == {
        "py_modules": [str(package)],
        "working_dir": str(tmp_path),
        "pip": ["einops"],
        "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(jobs.STOP_WAIT_S), "A": "file", "B": "cli"},
        "excludes": ["*.bin"],
    }
    # The local paths exist only here: the cluster-side `d9d train` runs inside the job's environment.
    assert sent["entrypoint"].endswith("--set cluster.runtime_env=null")

    with pytest.raises(ValueError, match="disagree"):
        jobs.submit(
            config,
            "http://head:8265",
            working_dir=tmp_path / "plugins",
            runtime_env=RuntimeEnvConfig(working_dir=str(tmp_path)),
        )


_DRIVER = """
import json, sys
from d9d.cluster import TrainingJob
job = TrainingJob(json.loads(sys.argv[2])).start(address=sys.argv[1])
summary = job.result(timeout=240)
print(summary.status, summary.steps)
"""


def test_a_plugin_package_reaches_the_ranks_through_the_runtime_env(ray_head: Head, tmp_path: Path) -> None:  # noqa: F811
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


def test_a_ray_job_submit_run_is_found_through_its_coordinator(ray_head: Head, tmp_path: Path) -> None:  # noqa: F811
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


def test_a_detached_run_is_found_through_its_record(ray_head: Head, tmp_path: Path) -> None:  # noqa: F811
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
