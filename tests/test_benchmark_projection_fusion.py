"""`benchmarks/projection_fusion.py --smoke` (CPU, float32): the run-time concatenated q/k/v and gate/up
projections compute what the separate projections compute, so the GPU timing compares equal models. No
number is checked for speed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_fixtures import run_benchmark


def test_fused_projection_variants_match_the_separate_ones(tmp_path: Path) -> None:
    out = tmp_path / "fusion.json"
    done = run_benchmark("projection_fusion.py", "--smoke", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    blocks = json.loads(out.read_text())["blocks"]
    assert set(blocks) == {"separate", "qkv", "gate_up", "both"}
    assert blocks["separate"]["relative_error"] == 0.0
    for variant in ("qkv", "gate_up", "both"):
        assert blocks[variant]["relative_error"] < 1e-5, (variant, blocks[variant])
