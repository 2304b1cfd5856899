"""`benchmarks/sort_keys.py --smoke` (CPU): a stable argsort of expert ids gives the int64 order in every
key dtype the permutation may sort them as. No number is checked for speed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_fixtures import run_benchmark


def test_every_key_dtype_sorts_in_the_int64_order(tmp_path: Path) -> None:
    out = tmp_path / "sort.json"
    done = run_benchmark("sort_keys.py", "--smoke", "--tokens", "512", "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {key: row for key, row in result.items() if key.startswith("argsort ")}
    assert set(rows) == {"argsort int64", "argsort int32", "argsort int16", "argsort uint8"}
    assert all(row["same_order"] for row in rows.values())
