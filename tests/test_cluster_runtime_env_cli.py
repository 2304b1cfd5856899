"""`d9d train` takes the same `--runtime-env FILE` / `--runtime-env-json` as `d9d submit` (shared job
options), merged over the job file's `cluster.runtime_env`, and the result is the runtime environment the
driver joins Ray with (`connect(address, runtime_env=...)` -> `ray.init`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

import d9d.cluster.client as client
from d9d.cli.main import build_parser, main
from tests.cluster_fixtures import toy_job


class _Joined(Exception):
    """Raised by the stand-in `ray.init`: the test needs what it was called with, not a cluster."""


def _job_file(tmp_path: Path) -> Path:
    (tmp_path / "pkg_a").mkdir()
    (tmp_path / "pkg_b").mkdir()
    job = toy_job("renv-train", tmp_path / "run")
    job["cluster"]["runtime_env"] = {
        "py_modules": [str(tmp_path / "pkg_a")],
        "env_vars": {"A": "file", "B": "file"},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_train_and_submit_share_the_runtime_env_options(tmp_path: Path) -> None:
    parser = build_parser()
    for command in ("train", "submit"):
        args = parser.parse_args(
            [command, "job.yaml", "--runtime-env", "env.yaml", "--runtime-env-json", "{}"]
        )
        assert args.runtime_env == Path("env.yaml") and args.runtime_env_json == "{}"


def test_train_joins_ray_with_the_merged_runtime_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = _job_file(tmp_path)
    (tmp_path / "env.yaml").write_text(yaml.safe_dump({"py_modules": ["pkg_b"], "env_vars": {"B": "file2"}}))
    joined: dict[str, Any] = {}

    def init(**kwargs: Any) -> None:
        joined.update(kwargs)
        raise _Joined

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(client, "_job_runtime_env", None)
    inline = json.dumps({"env_vars": {"B": "cli", "C": "cli"}, "pip": ["einops"]})
    with pytest.raises(_Joined):
        main(["train", str(config), "--cpu", "--runtime-env", "env.yaml", "--runtime-env-json", inline])
    env = joined["runtime_env"]
    # The job file's entries first, then the file's (relative paths resolved here), then the inline JSON's.
    assert env["py_modules"] == [str(tmp_path / "pkg_a"), str(tmp_path / "pkg_b")]
    assert env["env_vars"] == {"A": "file", "B": "cli", "C": "cli"}
    assert env["pip"] == ["einops"]


def test_a_bad_runtime_env_option_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _job_file(tmp_path)
    assert main(["train", str(config), "--runtime-env-json", "[1]"]) == 2
    assert "--runtime-env-json" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"py_modules": ["no/such/dir"]}))
    assert main(["train", str(config), "--runtime-env", str(tmp_path / "bad.yaml")]) == 2
    assert "no/such/dir" in capsys.readouterr().err
