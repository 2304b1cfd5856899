"""Host time the gradient synchronizer adds to each microbatch's backward, against autograd accumulation.

A data-parallel replica accumulates each microbatch's gradients into the synchronizer's buckets through
per-parameter hooks (d9d.parallel.grad_sync). At small microbatches the host issues that work for every
parameter and microbatch, so its time can bound the step (2 × H200, replicas at 2-sequence microbatches:
docs/benchmarks.md, session 30). This script isolates it: a graph whose backward only produces one gradient
per parameter (each parameter times a constant, summed), run for `--microbatches` backwards per step,

- `autograd`: plain accumulation into `.grad` (the floor);
- `synchronizer`: the same with a `GradientSynchronizer` over a one-rank mesh (its hooks and bucket work,
  no collective), `wait()` at the end of each step.

The figure is host wall time per microbatch (the device is synchronized only around the timed window).
Every step checks that the synchronizer's gradients equal autograd's.

    python benchmarks/grad_sync_host.py [--microbatches 4] [--steps 20] [--out FILE]   # CUDA if present

Shapes: Qwen3-0.6B's 310 parameter tensors, each shrunk to a few elements (the host cost does not depend on
the size; the device work stays negligible, so the time is the host's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from throughput.common import DENSE, sync_device  # benchmarks/ is the script's directory: on sys.path

from d9d.core.context import init_process_group
from d9d.parallel.grad_sync import GradientSynchronizer, SyncedParam

PER_LAYER = 11  # q, k, v, o, gate, up, down, two norms, q/k norms
TENSORS = 2 + DENSE["num_layers"] * PER_LAYER  # + embedding, final norm


def run(mode: str, device: torch.device, microbatches: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, device=device, dtype=torch.bfloat16)) for _ in range(TENSORS)]
    scales = torch.linspace(0.5, 1.5, microbatches, device=device, dtype=torch.bfloat16)
    sync = None
    if mode == "synchronizer":
        mesh = init_device_mesh(device.type, (1,))
        sync = GradientSynchronizer(
            [SyncedParam(f"p{i}", p, mesh) for i, p in enumerate(params)], num_microbatches=microbatches
        )

    def step() -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        for m in range(microbatches):
            loss = torch.stack([(p * scales[m]).sum() for p in params]).sum()
            loss.backward()
        if sync is not None:
            sync.wait()
        return [p.grad for p in params]  # type: ignore[misc]

    for _ in range(3):
        grads = step()
    want = scales.float().sum().to(torch.bfloat16)
    times = []
    for _ in range(steps):
        sync_device(device)
        start = time.perf_counter()
        grads = step()
        sync_device(device)
        times.append((time.perf_counter() - start) / microbatches)
        for g in grads:
            torch.testing.assert_close(g, torch.full_like(g, float(want)), rtol=2e-2, atol=0)
    if sync is not None:
        sync.close()
    median = statistics.median(times)
    return {"mode": mode, "host_ms_per_microbatch": median * 1e3, "tensors": TENSORS}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    init_process_group(backend, device=device, store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    rows = [run(mode, device, args.microbatches, args.steps) for mode in ("autograd", "synchronizer")]
    floor = rows[0]["host_ms_per_microbatch"]
    for row in rows:
        row["added_ms_per_microbatch"] = row["host_ms_per_microbatch"] - floor
        print(
            f"{row['mode']:>12}: {row['host_ms_per_microbatch']:.3f} ms per microbatch "
            f"(+{row['added_ms_per_microbatch']:.3f} over autograd; {TENSORS} tensors)"
        )
    meta = {"torch": torch.__version__, "device": str(device), "microbatches": args.microbatches}
    if args.out is not None:
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
