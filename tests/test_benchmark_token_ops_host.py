"""`benchmarks/token_ops_host.py --smoke` (CPU): the plain-Function and native-ATen variants of the token
permute and combine give the custom ops' outputs and gradients. No number is checked for speed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_fixtures import run_benchmark


def test_every_variant_moves_tokens_as_the_custom_ops_do(tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    done = run_benchmark("token_ops_host.py", "--smoke", "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    variants = json.loads(out.read_text())["variants"]
    assert set(variants) == {"custom-op", "function", "aten"}
    for name, row in variants.items():
        assert row["max_abs_diff_vs_custom_op"] < 1e-5, (name, row)
        assert row["permute"]["forward_host_us"] > 0 and row["combine"]["forward_backward_host_us"] > 0
