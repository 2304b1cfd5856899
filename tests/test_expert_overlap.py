"""The overlapped expert exchange (`overlap_chunks`) and the two-batch overlap (`two_batch_overlap`) through
the engine on gloo ranks: the same training as the exchange without overlap, with the MoE blocks compiled
(the exchange a graph break; the overlapped one runs its experts eagerly inside the compiled block). Their
orders of transfers and compute, and their results in float64, are tested in test_parallel_expert.py and
test_two_batch_overlap.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.test_exchange_capacity import DP2_EP2, _train

SEQUENTIAL = {"kind": "all_to_all"}
OVERLAPPED = {"kind": "all_to_all", "overlap_chunks": 2}
TWO_BATCH = {"kind": "all_to_all", "two_batch_overlap": True}


@pytest.mark.distributed
def test_overlapped_exchanges_train_as_the_sequential_one_in_compiled_blocks(tmp_path: Path) -> None:
    """dp 2 × ep 2, microbatches of 2 rows, 6 steps, the blocks compiled (the exchange a graph break either
    way; the overlapped one runs its experts inside it; the two-batch overlap runs each block's two parts
    through it): losses, gradient norms, MoE metrics and final parameters of each run against the sequential
    exchange's, to float32 rounding. (Eagerly, the float64 tests cover them.)"""
    sections = {"compile": {"enabled": True, "backend": "aot_eager"}}
    runs = (("sequential", SEQUENTIAL), ("overlapped", OVERLAPPED), ("two_batch", TWO_BATCH))
    for name, backend in runs:
        run_distributed(_train, 2, name, backend, DP2_EP2, None, sections, tmp_dir=tmp_path, timeout=300)
    want = torch.load(tmp_path / "sequential.pt")
    for name, _ in runs[1:]:
        got = torch.load(tmp_path / f"{name}.pt")
        # Not bitwise in float32: each chunk's (part's) experts multiply fewer rows (CPU matmul kernels block
        # them differently); in float64 the layers match to 1e-12.
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=0, msg=name)
        for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"], strict=True)):
            shared = sorted(k for k in w if k.startswith("moe/") or k in ("loss", "grad_norm"))
            assert shared, step
            torch.testing.assert_close(
                {k: g[k] for k in shared}, {k: w[k] for k in shared}, rtol=1e-4, atol=1e-6, msg=name
            )
        for rank in range(2):
            a = torch.load(tmp_path / f"{name}-{rank}.params.pt")
            b = torch.load(tmp_path / f"sequential-{rank}.params.pt")
            assert a.keys() == b.keys()
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=f"{name} rank {rank} {k}")
