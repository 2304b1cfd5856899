"""`benchmarks/gc_pause.py` end to end on a 2-layer eager rank (CPU): it trains through the engine and
measures what it says. No number is checked for speed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_fixtures import run_benchmark


def test_gc_pause_counts_and_times_the_collections(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    done = run_benchmark("gc_pause.py", "--layers", "2", "--eager", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["layers"] == 2 and result["compiled"] is False and result["device"] == "cpu"
    # the freeze took (nearly) every tracked object: what a full collection then skips
    tracked, frozen = result["tracked_objects"], result["frozen_objects"]
    assert tracked > 10_000 and abs(tracked - frozen) < tracked // 10
    assert all(result[key] >= 0 for key in ("full_ms", "young_ms", "full_frozen_ms"))
