"""Host time of one fused AdamW step over a model's parameters as FSDP leaves them (DTensors), three ways:

- `dtensor`: `Adam.step` over the DTensors, as torch runs it (DTensor's dispatcher works out the sharding of
  the one `_fused_adamw_` call over every argument, each step);
- `shards`: `PipelinedOptimizer.step`, which runs the same fused update on the local shards once the state
  exists (what the engine does);
- `plain`: `Adam.step` over plain tensors of the same shapes (the floor: one rank without DTensors).

Each step passes fresh `grad_scale` and `found_inf` tensors, as the engine's training step does. The host
time is the wall time of the calls that queue the step (the GPU runs behind them; it is synchronized only
around the timed window). Both DTensor rows also check that they leave bitwise-equal parameters.

    python benchmarks/optimizer_host.py [--steps 20] [--out FILE]   # CUDA, one rank (NCCL)
    python benchmarks/optimizer_host.py --smoke                      # CPU (gloo): a small model

Shapes: Qwen3-0.6B's 310 parameter tensors (28 layers, hidden 1024, vocabulary 151,936) in bf16; `--smoke`
keeps the tensor count and shrinks every tensor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from throughput.common import sync_device  # benchmarks/ is the script's directory: on sys.path

from d9d.core.context import init_process_group
from d9d.pipeline.optim import PipelinedOptimizer

LAYERS, HIDDEN, VOCAB = 28, 1024, 151_936


def shapes(smoke: bool) -> list[tuple[int, ...]]:
    h = 16 if smoke else HIDDEN
    layer = [(2 * h, h), (h, h), (h, h), (h, 2 * h), (3 * h, h), (3 * h, h), (h, 3 * h), (128,), (128,)]
    return [(h,)] * (2 * LAYERS + 1) + layer * LAYERS + [(64 if smoke else VOCAB, h)]


def run(kind: str, device: torch.device, dtype: torch.dtype, steps: int, smoke: bool) -> dict[str, Any]:
    mesh = init_device_mesh(device.type, (1,))
    torch.manual_seed(0)
    tensors = [torch.randn(s, device=device, dtype=dtype) for s in shapes(smoke)]
    params = [
        torch.nn.Parameter(t if kind == "plain" else distribute_tensor(t, mesh, [Shard(0)])) for t in tensors
    ]
    opt = PipelinedOptimizer({0: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)})
    inner = opt.optimizers[0]
    g = torch.Generator(device=device).manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, device=device, dtype=dtype, generator=g)
        if kind != "plain":
            p.grad = distribute_tensor(p.grad, mesh, [Shard(0)])

    def step() -> None:
        scale = torch.tensor(2.0, device=device)
        skip = torch.tensor(0.0, device=device)
        if kind == "shards":  # the first step creates the state: the host decides on it (as the engine)
            opt.step(skip_if=skip if opt.skips_on_device else None, grad_divisor=scale)
            return
        inner.grad_scale, inner.found_inf = scale, skip  # type: ignore[attr-defined]  # as Adam.step reads
        inner.step()

    for _ in range(3):  # the first creates the state
        step()
    sync_device(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    host_ms = (time.perf_counter() - start) / steps * 1e3
    sync_device(device)
    return {
        "kind": kind,
        "params": len(params),
        "host_ms": round(host_ms, 3),
        "final": [p.detach().to_local().clone() if kind != "plain" else p.detach().clone() for p in params],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, small tensors")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs CUDA (or --smoke)")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    backend = "gloo" if args.smoke else "nccl"
    # one rank on an in-memory store, as `python -m d9d.engine.launch` starts one: no port to agree on
    init_process_group(backend, device=device, store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows = [run(kind, device, dtype, args.steps, args.smoke) for kind in ("dtensor", "shards", "plain")]
    by_kind = {r["kind"]: r for r in rows}
    equal = all(
        torch.equal(a, b)
        for a, b in zip(by_kind["dtensor"]["final"], by_kind["shards"]["final"], strict=True)
    )
    print(f"torch {torch.__version__}, {device}, {rows[0]['params']} parameters, {args.steps} steps")
    print("| update | host ms per step |\n|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['host_ms']:.2f} |")
    print(f"dtensor and shards bitwise equal: {equal}")
    result = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "steps": args.steps,
        "rows": [{k: v for k, v in r.items() if k != "final"} for r in rows],
        "bitwise_equal": equal,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    if not equal:
        raise SystemExit("the local-shard update differs from Adam.step over the DTensors")


if __name__ == "__main__":
    main()
