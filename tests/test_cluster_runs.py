"""Runtime environments (`cluster.runtime_env`, `d9d submit --runtime-env*`) checked without a cluster: the
config's validation, the driver's import check through the environment, and `d9d submit`'s merge of the
command line over the job file. A plugin package reaching the ranks through the environment, and finding
runs by name (`run.json`, the named coordinator; `d9d status/logs/stop/list`), run on the `ray start --head`
cluster of tests/test_cluster_cli.py, which they share rather than start one of their own."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from d9d.cluster.reach import SUBMITTED_PATHS_ENV
from d9d.engine.config import ConfigError
from tests.test_cluster_cli import PKG, _plugin, _plugin_job, _write


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
