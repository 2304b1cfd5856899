from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
