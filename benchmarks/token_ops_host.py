"""Host and device cost per call of the MoE token-moving ops, the eager expert-parallel exchange's four calls
per layer forward (two permutes, two combines) and their backward, which py-spy put at ~0.37 ms of host time
each on one H200, most of it in Triton's Python launcher (docs/benchmarks.md, session 18).

    python benchmarks/token_ops_host.py [--tokens 16384] [--top-k 8] [--hidden 1024] [--experts 16] [--out F]
    python benchmarks/token_ops_host.py --smoke     # CPU: the variants agree; no timing is meaningful there

Variants, each a permute (`scatter_rows`) and a weighted combine (`gather_sum`), forward and backward:
- `custom-op`: the torch.library custom ops `d9d::moe_scatter_rows` / `moe_gather_sum` with their autograd
  (Triton on CUDA), as a compiled region calls them and as the eager exchange did until session 19;
- `function`: `d9d.kernels.moe.permute_tokens` / `combine_tokens` called eagerly, which since session 19
  run the same kernels through plain `torch.autograd.Function`s: what the custom-op dispatch costs;
- `aten`: native ATen compositions in `torch.autograd.Function`s: `index_select` to permute (the inverse
  permutation built by one `index_put`), a gather and a batched matmul with the weights to combine, their
  gradients the mirror images. More memory traffic (the combine materializes the [tokens·k, hidden] rows),
  cheaper launches.

Per variant and op: host µs per call (calls issued back to back with no synchronization, after a warm-up:
the time the host needs to issue one), device ms per call (synchronized, CUDA events), and, once, the
largest difference from the `custom-op` results (outputs and gradients). The slots are one rank's at FSDP
4 × EP 4 by default (16 local experts; top-k over them, as the receiver's regroup sees its rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from throughput.common import cuda_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from d9d.kernels.backend import resolve_backend
from d9d.kernels.moe import combine_tokens, expert_permutation, permute_tokens

Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class _AtenPermute(torch.autograd.Function):
    """rows = x[source token of each row]; every row is some slot's (a full permutation of the copies)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slot_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
        tokens, k = slot_rows.shape
        source = torch.empty(num_rows, dtype=torch.long, device=x.device)
        source[slot_rows.reshape(-1)] = torch.arange(tokens, device=x.device).repeat_interleave(k)
        ctx.save_for_backward(slot_rows)
        return x.index_select(0, source)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (slot_rows,) = ctx.saved_tensors
        tokens, k = slot_rows.shape
        gathered = grad.index_select(0, slot_rows.reshape(-1)).view(tokens, k, -1)
        return gathered.sum(1, dtype=torch.float32).to(grad.dtype), None, None


class _AtenCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weights: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
        tokens, k = slot_rows.shape
        gathered = rows.index_select(0, slot_rows.reshape(-1)).view(tokens, k, -1)
        ctx.save_for_backward(rows, weights, slot_rows)
        return torch.bmm(weights.unsqueeze(1), gathered).squeeze(1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        rows, weights, slot_rows = ctx.saved_tensors
        tokens, k = slot_rows.shape
        flat = slot_rows.reshape(-1)
        grad_rows = torch.empty_like(rows)
        grad_rows[flat] = (weights.unsqueeze(2) * grad.unsqueeze(1)).reshape(tokens * k, -1)
        gathered = rows.index_select(0, flat).view(tokens, k, -1)
        grad_w = torch.bmm(gathered, grad.unsqueeze(2)).squeeze(2)
        return grad_rows, grad_w, None


def _backend(x: torch.Tensor) -> str:
    return resolve_backend("auto", x.device)


VARIANTS: dict[str, tuple[Op, Op]] = {
    "custom-op": (
        lambda x, w, s, rows, n: torch.ops.d9d.moe_scatter_rows(x, None, s, n, _backend(x)),
        lambda x, w, s, rows, n: torch.ops.d9d.moe_gather_sum(rows, w, s, _backend(rows)),
    ),
    "function": (
        lambda x, w, s, rows, n: permute_tokens(x, s, n),
        lambda x, w, s, rows, n: combine_tokens(rows, s, weights=w),
    ),
    "aten": (
        lambda x, w, s, rows, n: _AtenPermute.apply(x, s, n),
        lambda x, w, s, rows, n: _AtenCombine.apply(rows, w, s),
    ),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_us(call: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median host time to issue one call, calls back to back (the device runs behind)."""
    for _ in range(3):
        call()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    _sync(device)
    return statistics.median(times) * 1e6


def _device_ms(call: Callable[[], object], device: torch.device, iters: int) -> float | None:
    return cuda_ms(call, iters) if device.type == "cuda" else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="CPU, small shapes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.iters = min(args.tokens, 64), min(args.hidden, 32), 3
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(args.experts, generator=g)[: args.top_k] for _ in range(args.tokens)])
    slots = expert_permutation(ids.to(device), args.experts).slot_rows
    num_rows = slots.numel()
    x = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype).requires_grad_()
    rows = torch.randn(num_rows, args.hidden, generator=g).to(device, dtype).requires_grad_()
    w = torch.rand(args.tokens, args.top_k, generator=g).to(device, dtype).requires_grad_()
    dy_rows = torch.randn(num_rows, args.hidden, generator=g).to(device, dtype)
    dy = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)

    def results(variant: str) -> list[torch.Tensor]:
        permute, combine = VARIANTS[variant]
        out_rows = permute(x, w, slots, rows, num_rows)
        out = combine(x, w, slots, rows, num_rows)
        grads = torch.autograd.grad((out_rows, out), (x, rows, w), (dy_rows, dy))
        return [out_rows.detach(), out.detach(), *grads]

    reference = results("custom-op")
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"tokens": args.tokens, "top_k": args.top_k, "hidden": args.hidden, "experts": args.experts},
        "dtype": str(dtype),
        "variants": {},
    }
    for variant, (permute, combine) in VARIANTS.items():
        diff = max(
            float((got.float() - want.float()).abs().max())
            for got, want in zip(results(variant), reference, strict=True)
        )
        row: dict[str, Any] = {"max_abs_diff_vs_custom_op": diff}
        for name, op, grad_in, dy_op in (("permute", permute, x, dy_rows), ("combine", combine, rows, dy)):
            forward = lambda op=op: op(x, w, slots, rows, num_rows)  # noqa: E731
            both = lambda op=op, grad_in=grad_in, dy_op=dy_op: torch.autograd.grad(  # noqa: E731
                op(x, w, slots, rows, num_rows), (grad_in,), dy_op
            )
            row[name] = {
                "forward_host_us": _host_us(forward, device, args.iters),
                "forward_backward_host_us": _host_us(both, device, args.iters),
                "forward_device_ms": _device_ms(forward, device, args.iters),
                "forward_backward_device_ms": _device_ms(both, device, args.iters),
            }
        report["variants"][variant] = row
        print(variant, json.dumps(row), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
