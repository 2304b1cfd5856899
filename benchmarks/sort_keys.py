"""Why `expert_permutation` sorts narrow keys: a stable `torch.argsort` of expert ids per key dtype, and the
permutation itself, on the MoE benchmark's shape (16,384 tokens, top-8 of 64 experts by default).

    python benchmarks/sort_keys.py [--out FILE]      # CUDA: GPU time (CUDA events) and kernels per call
    python benchmarks/sort_keys.py --smoke           # CPU: every key dtype gives the int64 order

A GPU radix sort makes one pass per key byte, so the kernel count and time fall with the key's width; the
order of a stable sort does not depend on it (checked here on every run).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from throughput.common import cuda_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from d9d.kernels.moe import expert_permutation

DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _kernels(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("sort_keys.py needs CUDA (or --smoke)")
    device = torch.device("cuda" if cuda else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    topk = torch.rand(args.tokens, args.experts, device=device, generator=g).topk(args.top_k, dim=1).indices
    ids = topk.reshape(-1)
    reference = torch.argsort(ids, stable=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", **vars(args)}
    for dtype in DTYPES:
        key = ids.to(dtype)
        row: dict[str, Any] = {"same_order": bool(torch.equal(torch.argsort(key, stable=True), reference))}
        if cuda:
            row |= {"gpu_ms": cuda_ms(lambda key=key: torch.argsort(key, stable=True))}
            row |= {"kernels": _kernels(lambda key=key: torch.argsort(key, stable=True))}
        result[f"argsort {str(dtype).removeprefix('torch.')}"] = row
    if cuda:
        perm = lambda: expert_permutation(topk, args.experts)  # noqa: E731
        result["expert_permutation"] = {"gpu_ms": cuda_ms(perm), "kernels": _kernels(perm)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
