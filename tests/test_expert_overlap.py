"""The overlapped expert exchange (`overlap_chunks`) through the engine on gloo ranks: the same training as
the exchange without overlap, with the MoE blocks compiled (the exchange and its experts then run eagerly
inside the compiled block). Its order of transfers and compute, and its results against one
process in float64, are tested in test_parallel_expert.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.test_exchange_capacity import DP2_EP2, _train

SEQUENTIAL = {"kind": "all_to_all"}
OVERLAPPED = {"kind": "all_to_all", "overlap_chunks": 2}


@pytest.mark.distributed
def test_overlapped_exchange_trains_as_the_sequential_one_in_compiled_blocks(tmp_path: Path) -> None:
    """dp 2 × ep 2, 6 steps, the blocks compiled (the exchange a graph break either way; the overlapped one
    runs its experts inside it): losses, gradient norms, MoE metrics and final parameters of both runs, to
    float32 rounding. (Eagerly, the layer test against one process in float64 covers it.)"""
    sections = {"compile": {"enabled": True, "backend": "aot_eager"}}
    for name, backend in (("sequential", SEQUENTIAL), ("overlapped", OVERLAPPED)):
        run_distributed(_train, 2, name, backend, DP2_EP2, None, sections, tmp_dir=tmp_path, timeout=300)
    want, got = torch.load(tmp_path / "sequential.pt"), torch.load(tmp_path / "overlapped.pt")
    # Not bitwise in float32: each chunk's experts multiply fewer rows (CPU matmul kernels block them
    # differently); in float64 the layer matches one process to 1e-12 (test_parallel_expert.py).
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=0)
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"], strict=True)):
        shared = sorted(k for k in w if k.startswith("moe/") or k in ("loss", "grad_norm"))
        assert shared, step
        torch.testing.assert_close({k: g[k] for k in shared}, {k: w[k] for k in shared}, rtol=1e-4, atol=1e-6)
    for rank in range(2):
        a = torch.load(tmp_path / f"overlapped-{rank}.params.pt")
        b = torch.load(tmp_path / f"sequential-{rank}.params.pt")
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=f"rank {rank} {k}")
