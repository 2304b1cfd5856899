"""`benchmarks/grad_sync_host.py` on CPU (gloo, one rank): both rows run, the synchronizer's gradients are
checked inside the script against the accumulated sum, and every row is reported. No number is checked for
speed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_fixtures import run_benchmark


def test_both_rows_run_and_report(tmp_path: Path) -> None:
    out = tmp_path / "grad_sync.json"
    done = run_benchmark(
        "grad_sync_host.py", "--microbatches", "2", "--steps", "3", "--out", str(out), timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["mode"] for row in result["rows"]] == ["autograd", "synchronizer"]
    assert all(row["tensors"] == 310 and row["host_ms_per_microbatch"] > 0 for row in result["rows"])
    assert result["rows"][0]["added_ms_per_microbatch"] == 0
