"""Attention kernels on one GPU, forward + backward, at the training benchmark's shapes.

    python benchmarks/attention_kernels.py [--batch 8] [--seq 2048] [--heads 16] [--kv-heads 8] [--dim 128]
                                           [--doc-len 512] [--out result.json]

Rows (each under try/except: a kernel the image lacks is recorded as an error, the table goes on):
- causal batches: SDPA as d9d's `torch`/`auto` backends call it (`is_causal`, native GQA) with the default
  kernel choice, then pinned to flash and to cuDNN (native GQA and with k/v repeated), FlexAttention
  compiled with a causal block mask, and cuDNN pinned inside a `torch.compile`d function (whether dynamo
  keeps the `sdpa_kernel` choice);
- packed documents (lengths drawn around `--doc-len`, the training benchmark's packing): FlexAttention with a
  document block mask (d9d's `auto` path for documents) and `torch.nn.attention.varlen.varlen_attn` where
  the installed torch has it.
Times are CUDA-event medians of 20 calls after 5, forward + backward; TFLOP/s counts the causal half.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def _time(fn: Callable[[], torch.Tensor], grads: list[torch.Tensor]) -> float:
    def once() -> None:
        out = fn()
        out.backward(torch.ones_like(out))
        for g in grads:
            g.grad = None

    for _ in range(5):
        once()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def _doc_lengths(seq: int, mean: int, gen: torch.Generator) -> list[int]:
    lengths: list[int] = []
    while sum(lengths) < seq:
        lengths.append(max(16, int(torch.empty(1).exponential_(1 / mean, generator=gen).item())))
    lengths[-1] -= sum(lengths) - seq
    return [n for n in lengths if n > 0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = torch.device("cuda")
    b, s, h, kvh, d = args.batch, args.seq, args.heads, args.kv_heads, args.dim
    q = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kvh, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kvh, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grads = [q, k, v]
    scale = d**-0.5
    groups = h // kvh

    def sdpa(backend: SDPBackend | None, repeat: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            kk, vv = (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)) if repeat else (k, v)
            if backend is None:
                return F.scaled_dot_product_attention(
                    q, kk, vv, is_causal=True, scale=scale, enable_gqa=not repeat
                )
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(
                    q, kk, vv, is_causal=True, scale=scale, enable_gqa=not repeat
                )

        return run

    flex = torch.compile(flex_attention)
    causal_mask = create_block_mask(lambda _b, _h, qi, ki: qi >= ki, None, None, s, s, device=dev)

    @torch.compile
    def compiled_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    gen = torch.Generator().manual_seed(0)
    docs = [_doc_lengths(s, args.doc_len, gen) for _ in range(b)]
    doc_ids = torch.tensor(
        [[i for i, n in enumerate(row) for _ in range(n)] for row in docs], device=dev, dtype=torch.int32
    )

    def same_doc(bi: Any, _h: Any, qi: Any, ki: Any) -> Any:
        return (qi >= ki) & (doc_ids[bi, qi] == doc_ids[bi, ki])

    doc_mask = create_block_mask(same_doc, b, None, s, s, device=dev)
    cu = torch.tensor(
        [0] + [sum(row[: i + 1]) + r * s for r, row in enumerate(docs) for i in range(len(row))]
    )
    cu = cu.to(dev, torch.int32)
    max_doc = max(max(row) for row in docs)

    def varlen() -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn as kernel

        varlen_attn: Any = kernel  # its signature changed between torch releases
        flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
        try:
            out = varlen_attn(
                *flat, cu, cu, max_doc, max_doc, scale=scale, window_size=(-1, 0), enable_gqa=True
            )
        except TypeError:  # torch 2.11 has no enable_gqa: k/v repeated to the query heads
            k_rep, v_rep = (t.repeat_interleave(groups, 1) for t in flat[1:])
            out = varlen_attn(
                flat[0], k_rep, v_rep, cu, cu, max_doc, max_doc, scale=scale, window_size=(-1, 0)
            )
        assert isinstance(out, torch.Tensor)
        return out

    rows: dict[str, Callable[[], torch.Tensor]] = {
        "causal sdpa default (d9d auto)": sdpa(None, False),
        "causal sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION, False),
        "causal sdpa cudnn gqa": sdpa(SDPBackend.CUDNN_ATTENTION, False),
        "causal sdpa cudnn repeat-kv": sdpa(SDPBackend.CUDNN_ATTENTION, True),
        "causal sdpa efficient repeat-kv": sdpa(SDPBackend.EFFICIENT_ATTENTION, True),
        "causal sdpa cudnn compiled": lambda: compiled_cudnn(q, k, v),
        "causal flex compiled": lambda: flex(q, k, v, block_mask=causal_mask, scale=scale, enable_gqa=True),
        "docs flex compiled (d9d auto)": lambda: flex(
            q, k, v, block_mask=doc_mask, scale=scale, enable_gqa=True
        ),
        "docs varlen_attn": varlen,
    }
    causal_flops = 4 * b * h * s * s * d / 2 * 3.5  # fwd 2 matmuls, bwd 5: 3.5× the forward
    doc_flops = sum(4 * h * n * n * d / 2 * 3.5 for row in docs for n in row)
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "cudnn": torch.backends.cudnn.version(),  # type: ignore[no-untyped-call]
        "shape": vars(args) | {"out": None},
        "docs_per_row": [len(row) for row in docs],
        "rows": {},
    }
    print(f"torch {torch.__version__} on {results['device']}, cuDNN {results['cudnn']}")
    references: dict[bool, torch.Tensor] = {}
    for name, fn in rows.items():
        try:
            with torch.no_grad():  # each kernel against the first of its kind (varlen's layout: tokens first)
                out = fn().detach()
                if name.startswith("docs") and out.dim() == 3:
                    out = out.reshape(b, s, h, d).transpose(1, 2)
            ref = references.setdefault(name.startswith("docs"), out)
            diff = (out.float() - ref.float()).abs().max().item()
            ms = _time(fn, grads)
            flops = doc_flops if name.startswith("docs") else causal_flops
            results["rows"][name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_abs_diff": diff}
            print(f"{name:36s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  max|diff| {diff:.2e}")
        except Exception as e:  # a kernel the image lacks: recorded, the table goes on
            results["rows"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name:36s} error {type(e).__name__}: {str(e)[:200]}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
