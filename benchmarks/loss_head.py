"""The causal-LM loss head alone: d9d's chunked `linear_cross_entropy` against full logits.

Forward + backward of `sum(cross_entropy(hidden @ W.T, labels))` on the Qwen3 vocabulary (bf16 hidden
[tokens, 1024] and W [151936, 1024], float32 loss), in the same process:
  - full: the logits materialized in float32, `F.cross_entropy` (what transformers does),
  - d9d chunked, with the row-wise work on the PyTorch reference (`torch`) or the Triton kernels, the
    backward recomputing each chunk's logits (`recompute`) or the forward leaving the gradients of the
    sum (`eager`, the default).
Prints the median time of `--repeats` runs after warm-up, the peak memory, and the ratios to `full`;
beside each, the host's median time to issue the forward and backward (`issue`: from the call until
`backward()` returns, before the device is waited for) and how many device synchronizations one run makes
(`syncs`, counted with CUDA's sync debug mode). A row whose issue time is its whole time, or that syncs,
is bound by the host: what to look for where the head runs on 2,048-token microbatches (the last pipeline
stage, docs/benchmarks.md session 33).

    python benchmarks/loss_head.py --tokens 16384
    python benchmarks/loss_head.py --tokens 2048 --chunk 2048    # one pipeline microbatch of one sequence
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from d9d.kernels.backend import KernelBackend
from d9d.modules.heads import linear_cross_entropy


def measure(
    fn: Callable[[], torch.Tensor], params: list[torch.Tensor], repeats: int
) -> tuple[float, float, float, int]:
    """(median seconds, peak GiB, median seconds to issue, device synchronizations in one run)."""
    times, issued = [], []
    for i in range(repeats + 2):
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fn().backward()
        issue = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
            issued.append(issue - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    return statistics.median(times), peak, statistics.median(issued), count_syncs(fn, params)


def count_syncs(fn: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> int:
    """Device synchronizations of one forward and backward: CUDA's sync debug mode warns at each."""
    import warnings

    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # only the detector's own warnings (its first use also announces itself as a prototype feature)
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA")
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden, device="cuda") * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device="cuda")

    def full() -> torch.Tensor:
        return F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="none").sum()

    def chunked(backend: KernelBackend, eager: bool) -> Callable[[], torch.Tensor]:
        return lambda: linear_cross_entropy(
            hidden, [weight], labels, chunk_size=args.chunk, eager_grads=eager, backend=backend
        ).sum()

    rows: dict[str, Callable[[], torch.Tensor]] = {"full": full}
    for backend in ("torch", "triton"):
        for eager in (False, True):
            rows[f"{backend}, {'eager' if eager else 'recompute'}"] = chunked(backend, eager)
    results = {}
    for name, fn in rows.items():
        results[name] = measure(fn, [hidden, weight], args.repeats)
    base = results["full"][0]
    print(
        f"{args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab}, chunk {args.chunk}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    for name, (seconds, peak, issue, syncs) in results.items():
        print(
            f"{name:20s} {seconds * 1e3:8.2f} ms  peak {peak:6.2f} GiB  speed vs full {base / seconds:.3f}x  "
            f"issue {issue * 1e3:7.2f} ms  syncs {syncs}"
        )


if __name__ == "__main__":
    main()
