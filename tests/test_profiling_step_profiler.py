"""StepProfiler on CPU: traces appear exactly for the configured step window, one per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from d9d.profiling import NullProfiler, StepProfiler
from tests.harness import RankEnv, run_distributed


def _train_steps(hook: StepProfiler | NullProfiler, steps: int, marker_prefix: str = "work") -> None:
    with hook:
        for i in range(steps):
            with torch.profiler.record_function(f"{marker_prefix}{i}"):
                a = torch.randn(16, 16)
                (a @ a).sum()
            hook.step()


def _marked_steps(path: Path) -> set[int]:
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    return {int(n[len("work") :]) for n in names if n.startswith("work") and n[len("work") :].isdigit()}


def test_trace_written_for_window_only(tmp_path: Path) -> None:
    prof = StepProfiler(tmp_path, rank=3, wait=2, warmup=1, active=2)
    _train_steps(prof, 8)
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["rank00003-steps3-4.json"]
    assert prof.written == files
    # The trace holds the active steps' work and nothing from waiting, warmup or later steps.
    assert _marked_steps(files[0]) == {3, 4}


def test_no_trace_when_training_ends_before_window(tmp_path: Path) -> None:
    _train_steps(StepProfiler(tmp_path, rank=0, wait=2, warmup=1, active=2), 3)
    assert list(tmp_path.iterdir()) == []


def test_window_cut_short_keeps_recorded_steps(tmp_path: Path) -> None:
    _train_steps(StepProfiler(tmp_path, rank=0, wait=1, warmup=1, active=3), 3)
    (only,) = tmp_path.iterdir()
    assert only.name == "rank00000-steps2-2.json"
    assert _marked_steps(only) == {2}


def test_repeat_and_resumed_step_numbers(tmp_path: Path) -> None:
    prof = StepProfiler(tmp_path, rank=0, wait=1, warmup=1, active=1, repeat=2, first_step=100)
    _train_steps(prof, 6)
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "rank00000-steps102-102.json",
        "rank00000-steps105-105.json",
    ]
    assert [_marked_steps(p) for p in prof.written] == [{2}, {5}]


def test_null_profiler_writes_nothing(tmp_path: Path) -> None:
    _train_steps(NullProfiler(), 4)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("field", "kwargs"), [("wait", {"wait": -1}), ("active", {"active": 0}), ("repeat", {"repeat": 0})]
)
def test_bad_window_is_rejected(tmp_path: Path, field: str, kwargs: dict[str, int]) -> None:
    window = {"wait": 0, "warmup": 0, "active": 1} | kwargs
    repeat = window.pop("repeat", 1)
    with pytest.raises(ValueError, match=field):
        StepProfiler(tmp_path, rank=0, repeat=repeat, **window)


def _rank_body(env: RankEnv) -> None:
    _train_steps(StepProfiler(env.tmp_dir / "traces", env.rank, wait=1, warmup=1, active=1), 4)


@pytest.mark.distributed
def test_one_trace_per_rank(tmp_path: Path) -> None:
    run_distributed(_rank_body, 2, tmp_dir=tmp_path, timeout=120)
    names = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert names == ["rank00000-steps2-2.json", "rank00001-steps2-2.json"]
