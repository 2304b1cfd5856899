"""`d9d pipeline-sim`: the bubble table on stdout, a timeline PNG on disk, clear errors for bad shapes."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest

from d9d.cli.main import main


def test_prints_the_table_and_writes_the_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "zbv.png"
    assert (
        main(["pipeline-sim", "--schedule", "zbv", "--pp", "4", "--microbatches", "8", "-o", str(out)]) == 0
    )
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0].isdigit()]
    # ZBV with unit costs: every rank busy 6m = 48 slots, idle only the p - 1 = 3 slots of the fill.
    assert rows == [[str(r), "48", "3", "5.9%", "8"] for r in range(4)]
    assert "pipeline bubble 5.9%" in text
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 100 and image.shape[1] > 300


def test_costs_change_the_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "pipeline-sim",
        "--schedule",
        "1f1b",
        "--pp",
        "2",
        "--microbatches",
        "2",
        "-o",
        str(tmp_path / "x.png"),
    ]
    assert main([*args, "--forward", "2", "--backward-full", "2"]) == 0
    # 1F1B, p = 2, m = 2, F = B = 2: step (m + p - 1)(F + B) = 12, each rank idle (p - 1)(F + B) = 4.
    assert "step time 12," in capsys.readouterr().out


def test_refuses_impossible_shapes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["pipeline-sim", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "4"]
    assert main([*args, "-o", str(tmp_path / "x.png")]) == 2
    assert "dualpipev needs at least" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
