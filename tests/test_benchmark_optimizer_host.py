"""`benchmarks/optimizer_host.py --smoke` (CPU, gloo): the local-shard update and `Adam.step` over the
DTensors leave bitwise-equal parameters on the benchmark's shapes, and every row is reported. No number is
checked for speed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_fixtures import run_benchmark


def test_the_three_updates_run_and_the_dtensor_ones_agree(tmp_path: Path) -> None:
    out = tmp_path / "optimizer.json"
    done = run_benchmark("optimizer_host.py", "--smoke", "--steps", "3", "--out", str(out), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["kind"] for row in result["rows"]] == ["dtensor", "shards", "plain"]
    assert all(row["params"] == 310 and row["host_ms"] > 0 for row in result["rows"])
    assert result["bitwise_equal"] is True
