from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import d9d


def test_version_and_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "d9d.cli.main", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"d9d {d9d.__version__}"
    out = subprocess.run(
        [sys.executable, "-m", "d9d.cli.main", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: d9d" in out.stdout


def test_demo_takes_a_fresh_run_name_when_the_demo_ran_before(tmp_path: Path) -> None:
    from d9d.cli.commands.demo import RUN_NAME, fresh_run_name

    assert fresh_run_name(tmp_path) == RUN_NAME
    (tmp_path / RUN_NAME).mkdir()
    (tmp_path / f"{RUN_NAME}-2").mkdir()
    assert fresh_run_name(tmp_path) == f"{RUN_NAME}-3"


@pytest.mark.parametrize("command", ["status", "stop", "logs"])
def test_a_run_found_nowhere_names_the_directory_it_was_looked_for_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """A run name is looked up under `runs/` of the current directory: from anywhere else (the usual
    mistake) the answer says where it looked instead of only that no Ray job or coordinator was found."""
    from d9d.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main([command, "my-run", "--address", "http://127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert f"no run directory {tmp_path.resolve() / 'runs' / 'my-run'}" in err, err
    assert "--run-dir" in err


def test_submit_to_an_address_where_no_dashboard_answers_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The job is valid; only the Jobs API is not there (a wrong port, a GCS address instead of the
    dashboard's, a cluster that is down): exit status 2 and the address, not Ray's traceback."""
    import json

    from d9d.cli.main import main
    from tests.cluster_fixtures import toy_job

    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(json.dumps(toy_job("nowhere", tmp_path / "run")))
    assert main(["submit", "job.yaml", "--address", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("d9d submit: ") and "http://127.0.0.1:1" in err and "dashboard" in err, err
