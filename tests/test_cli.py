from __future__ import annotations

import subprocess
import sys

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
