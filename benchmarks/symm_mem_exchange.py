"""Feasibility of a sync-free expert exchange: PyTorch's NVSHMEM all-to-all with device-side split sizes
(`torch.ops.symm_mem.all_to_all_vdev_2d`), checked against an exchange computed from all ranks' inputs, and
timed against the path d9d takes today (an all-to-all of counts, one device→host read of the split sizes,
`all_to_all_single` of the rows).

Every rank routes `--tokens` random tokens to `--top-k` of `--experts` experts (uniform), sorts the copies
by global expert (rank-major, local-expert-minor: what `all_to_all_vdev_2d` reads), and exchanges them:

- `vdev_2d`: one call; the receiver gets its rows grouped by local expert, then source rank, each expert's
  group starting at a multiple of `--align`, with the (expert, source) sizes and offsets on the device. Its
  output buffer is sized for the worst case (every copy of every rank on this rank: ep · tokens · k rows),
  so nothing can overflow it.
- `host_splits`: counts exchanged, read by the host, rows exchanged by `all_to_all_single` (arriving by
  source, then local expert; the regroup by expert is not timed here).

CUDA only (NVSHMEM), at least two GPUs (NVSHMEM's rendezvous refuses a one-rank group); one process per GPU:

    torchrun --standalone --nproc-per-node 4 benchmarks/symm_mem_exchange.py --out symm.json
    torchrun --standalone --nproc-per-node 2 benchmarks/symm_mem_exchange.py --experts 32

The kernel handles at most 16 local experts and 32 ranks (its device asserts), so 64 experts need 4 ranks.

Prints whether NVSHMEM is available, whether every rank's received rows, sizes and offsets equal the
reference (exact: rows are copied, not computed), and the median milliseconds of each path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

# The kernel's own limits (asserted on the device in torch's NVSHMEM extension): one thread block of 16 warps,
# a warp per local expert, a lane per rank.
MAX_LOCAL_EXPERTS, MAX_RANKS = 16, 32


def expected_layout(counts: list[list[int]], rank: int, align: int) -> list[tuple[int, int]]:
    """(rows, offset) of every (local expert, source rank) block that `rank` receives, in that order:
    `counts[s][g]` rows of source s for global expert g, experts split evenly over the ranks (rank r owns
    experts [r·L, (r+1)·L)). Blocks follow each other; each expert's first block starts at a multiple of
    `align`, and an expert that receives nothing still takes `align` rows (PyTorch's documented layout of
    `all_to_all_vdev_2d`: CUTLASS's grouped matmul takes no empty group)."""
    world = len(counts)
    local = len(counts[0]) // world
    layout, position = [], 0
    for e in range(local):
        group_start = position
        for s in range(world):
            rows = counts[s][rank * local + e]
            layout.append((rows, position))
            position += rows
        length = position - group_start
        position = group_start + (-(-length // align) * align if length else align)
    return layout


def _time(fn: Any, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--align", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        raise SystemExit("symm_mem_exchange.py needs CUDA GPUs (NVSHMEM)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    import torch.distributed._symmetric_memory as symm_mem

    if world < 2:  # NVSHMEM's rendezvous asserts on a one-rank group (found on one H200)
        raise SystemExit("symm_mem_exchange.py needs at least 2 ranks (one GPU each)")
    if args.experts % world or args.experts // world > MAX_LOCAL_EXPERTS or world > MAX_RANKS:
        raise SystemExit(
            f"--experts {args.experts} over {world} ranks: all_to_all_vdev_2d takes at most "
            f"{MAX_LOCAL_EXPERTS} experts per rank (an even split) and {MAX_RANKS} ranks"
        )
    result: dict[str, Any] = {"world": world, "nvshmem": symm_mem.is_nvshmem_available(), **vars(args)}
    if not result["nvshmem"]:
        print(json.dumps(result))
        return
    symm_mem.set_backend("NVSHMEM")
    world_group = dist.group.WORLD
    assert world_group is not None
    group_name = world_group.group_name
    experts, k, hidden = args.experts, args.top_k, args.hidden
    local = experts // world
    copies = args.tokens * k
    torch.manual_seed(rank)
    ids = torch.rand(args.tokens, experts, device=device).topk(k, dim=1).indices.reshape(-1)
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=device).scatter_add_(0, ids, torch.ones_like(ids))
    rows = torch.randn(copies, hidden, device=device, dtype=torch.bfloat16)[order]  # sorted by global expert

    # Symmetric buffers: the same shape on every rank. The output holds the worst case plus alignment slack.
    max_out = world * copies + local * args.align
    send = symm_mem.empty(copies, hidden, dtype=torch.bfloat16, device=device)
    recv = symm_mem.empty(max_out, hidden, dtype=torch.bfloat16, device=device)
    in_splits = symm_mem.empty(experts, dtype=torch.int64, device=device)
    out_splits_offsets = symm_mem.empty(2, experts, dtype=torch.int64, device=device)
    for t in (send, recv, in_splits, out_splits_offsets):
        symm_mem.rendezvous(t, group_name)
    send.copy_(rows)
    in_splits.copy_(counts)

    def vdev_2d() -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d(
            send, recv, in_splits, out_splits_offsets, group_name, major_align=args.align
        )

    vdev_2d()
    torch.cuda.synchronize()

    # Reference: every rank's counts and rows, padded to one length, gathered.
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts)
    all_rows = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(all_rows, rows.contiguous())
    starts = [c.cumsum(0) - c for c in all_counts]
    layout = expected_layout([c.tolist() for c in all_counts], rank, args.align)
    got = list(zip(out_splits_offsets[0].tolist(), out_splits_offsets[1].tolist(), strict=True))
    ok = got == layout
    for e in range(local):
        g = rank * local + e
        for s in range(world):
            n, offset = layout[e * world + s]
            expected = all_rows[s][int(starts[s][g]) : int(starts[s][g]) + n]
            ok &= bool(torch.equal(recv[offset : offset + n], expected))
    result["matches_reference"] = ok

    recv_counts = torch.empty_like(counts)

    def host_splits() -> None:
        dist.all_to_all_single(recv_counts, counts)
        send_splits = counts.view(world, local).sum(1)
        recv_splits = recv_counts.view(world, local).sum(1)
        sizes = torch.stack([send_splits, recv_splits]).cpu().tolist()
        out = rows.new_empty(sum(sizes[1]), hidden)
        dist.all_to_all_single(out, rows, sizes[1], sizes[0])

    result["vdev_2d_ms"] = _time(vdev_2d, args.steps, args.warmup)
    result["host_splits_ms"] = _time(host_splits, args.steps, args.warmup)
    oks = [None] * world
    dist.all_gather_object(oks, ok)
    result["all_ranks_match"] = all(oks)
    if rank == 0:
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
