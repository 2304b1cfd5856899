"""`benchmarks/ep_exchange.py`: its smoke mode on 2 gloo ranks under torchrun (what it reports about the
wire, not its speed), and its expected-distinct-ranks formula against brute-force enumeration."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_fixtures import BENCH, import_benchmark
from tests.engine_fixtures import subprocess_env


@pytest.fixture(scope="module")
def bench():
    yield from import_benchmark("ep_exchange")


@pytest.mark.parametrize(("experts", "ep", "k"), [(8, 2, 3), (8, 4, 2), (12, 3, 4), (6, 2, 1)])
def test_expected_distinct_ranks_matches_enumeration(bench, experts: int, ep: int, k: int) -> None:
    local = experts // ep
    choices = list(itertools.combinations(range(experts), k))
    mean = sum(len({e // local for e in c}) for c in choices) / len(choices)
    assert bench.expected_distinct_ranks(experts, ep, k) == pytest.approx(mean, rel=1e-12)


@pytest.mark.distributed
def test_smoke_on_two_gloo_ranks(tmp_path: Path) -> None:
    out = tmp_path / "ep.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(BENCH / "ep_exchange.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(
        cmd, env=subprocess_env(GLOO_SOCKET_IFNAME="lo"), capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["ep"] == 2
    k = report["shape"]["top_k"]
    rows = {r["mode"]: r for r in report["results"]}
    assert set(rows) == {"dedup", "copies", "overlap"}
    assert rows["copies"]["rows_per_token"] == k  # one row per copy, exactly
    # the overlapped exchange sends the same rows, in two chunks' messages (counted on its layer pass)
    assert rows["overlap"]["rows_per_token"] == k
    assert rows["overlap"]["rows_per_token_off_rank"] == rows["copies"]["rows_per_token_off_rank"]
    # one row per (token, rank): at least one, at most ep, and fewer than the copies at this shape
    assert 1 <= rows["dedup"]["rows_per_token"] <= 2 < k
    assert rows["dedup"]["bytes_per_step"] < rows["copies"]["bytes_per_step"]
    layer = {"layer forward", "layer backward"}
    for name, r in rows.items():
        assert 0 < r["rows_per_token_off_rank"] < r["rows_per_token"]
        phases = layer if name == "overlap" else {"dispatch", "combine", "backward", *layer}
        assert set(r["median_s"]) == phases and r["layer_s"] > 0
        assert f"| {name} |" in proc.stdout
