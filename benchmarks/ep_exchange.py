"""The expert-parallel token exchange alone: deduplicated (one row per token and destination rank) against
one row per (token, expert) copy, the two modes of `AllToAllMoECommunication`, and the copy exchange in
two chunks whose transfers overlap the experts (`overlap`, `overlap_chunks: 2`).

Every rank routes `--tokens` random tokens (hidden `--hidden`, `--dtype`) to `--top-k` of `--experts`
distinct experts drawn uniformly (a balanced router), then times, per mode, with the device synchronized
and the ranks at a barrier between phases (the slowest rank's time, median of `--steps` after `--warmup`;
the modes take turns step by step): dispatch forward, combine forward, and backward through both (the
experts are a scaling, so only the exchange and its index work are timed). It counts what goes on the
wire by wrapping `dist.all_to_all_single`: hidden-state rows sent by all ranks (and those to another
rank), and bytes of every message (metadata and counts included), against the expected distinct ranks
per token, ep · (1 − C(E − E/ep, k) / C(E, k)).

Then, per mode, the whole MoE exchange with this rank's real experts (`GroupedExperts`, `--intermediate`):
`exchange` forward (dispatch, experts, combine) and its backward, timed as above (`layer forward`,
`layer backward`). That is where overlapping can show: the overlapped exchange has no separate dispatch
and combine phases, so it has only these two; its wire is counted on this pass.

    torchrun --standalone --nproc-per-node 4 benchmarks/ep_exchange.py          # the issue-28 shape
    torchrun --standalone --nproc-per-node 2 benchmarks/ep_exchange.py --smoke  # tiny, gloo on CPU

NCCL on CUDA when available (the rank's `LOCAL_RANK` GPU), gloo on CPU otherwise. `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from d9d.modules.moe.communication import RoutedTokens
from d9d.modules.moe.experts import GroupedExperts
from d9d.parallel.expert import AllToAllMoECommunication

MODES = ("dedup", "copies", "overlap")
EXCHANGE_PHASES = ("dispatch", "combine", "backward")  # timed apart; not for the overlapped mode
LAYER_PHASES = ("layer forward", "layer backward")


class WireCounter:
    """Counts what `all_to_all_single` is asked to send: host-known shapes, so counting syncs nothing."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden
        self.rows = 0  # hidden-state rows, this rank's self-send included
        self.rows_off_rank = 0
        self.bytes = 0  # every message
        self.bytes_off_rank = 0
        self._original = dist.all_to_all_single

    def __enter__(self) -> WireCounter:
        me = dist.get_rank()

        def counted(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            splits = kwargs.get("input_split_sizes", args[1] if len(args) > 1 else None)
            group = kwargs.get("group")
            size = dist.get_world_size(group)
            per_rank = list(splits) if splits is not None else [input.shape[0] // size] * size
            own = dist.get_group_rank(group, me) if group is not None else me
            row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
            self.bytes += input.shape[0] * row_bytes
            self.bytes_off_rank += (input.shape[0] - per_rank[own]) * row_bytes
            # hidden-state rows: [rows, hidden] in the activation dtype, or a byte message packing such a
            # row with its weights and ids (the deduplicated dispatch); counts and weights rows are smaller
            if input.dim() == 2 and (input.shape[1] == self.hidden or row_bytes > 2 * self.hidden):
                self.rows += input.shape[0]
                self.rows_off_rank += input.shape[0] - per_rank[own]
            return self._original(output, input, *args, **kwargs)

        dist.all_to_all_single = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self._original


def expected_distinct_ranks(experts: int, ep: int, k: int) -> float:
    """A token's k distinct experts drawn uniformly from E, L = E/ep per rank: rank r hosts none of them
    with probability C(E − L, k) / C(E, k)."""
    return ep * (1 - math.comb(experts - experts // ep, k) / math.comb(experts, k))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """`fn`'s result and its time on the slowest rank (ranks start together, the device is drained)."""
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)  # NCCL: on GPU
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return result, float(elapsed)


class Mode:
    """One exchange mode on this rank's batch (the same batch for every mode: the seed is the rank's)."""

    def __init__(self, args: argparse.Namespace, name: str, device: torch.device, dtype: torch.dtype) -> None:
        self.args, self.device, self.name = args, device, name
        self.comm = AllToAllMoECommunication(
            dist.group.WORLD, dedup=name == "dedup", overlap_chunks=2 if name == "overlap" else 1
        )
        local_experts = args.experts // dist.get_world_size()
        torch.manual_seed(99 + dist.get_rank())
        self.experts = GroupedExperts(local_experts, args.hidden, args.intermediate).to(device, dtype)
        g = torch.Generator().manual_seed(1234 + dist.get_rank())
        tokens, hidden = args.tokens, args.hidden
        self.x = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
        self.ids = torch.rand(tokens, args.experts, generator=g).topk(args.top_k, dim=1).indices.to(device)
        self.w = torch.rand(tokens, args.top_k, generator=g).to(device, dtype).requires_grad_()
        self.grad_out = torch.randn(tokens, hidden, generator=g).to(device, dtype)
        phases = EXCHANGE_PHASES if name != "overlap" else ()
        self.phases: dict[str, list[float]] = {p: [] for p in (*phases, *LAYER_PHASES)}
        self.wire: WireCounter | None = None

    def step(self, timed_step: bool) -> None:
        times: dict[str, float] = {}
        routed = RoutedTokens(self.x, self.ids, self.w, self.args.experts)
        with self._counted(layer=False):
            if "dispatch" in self.phases:
                self.x.grad = self.w.grad = None
                d, times["dispatch"] = timed(lambda: self.comm.dispatch(routed), self.device)
                out, times["combine"] = timed(lambda: self.comm.combine(d.hidden_states * 2, d), self.device)
                _, times["backward"] = timed(lambda: out.backward(self.grad_out), self.device)
        with self._counted(layer=True):
            self.x.grad = self.w.grad = None
            self.experts.zero_grad(set_to_none=True)
            out, times["layer forward"] = timed(lambda: self.comm.exchange(routed, self.experts), self.device)
            _, times["layer backward"] = timed(lambda: out.backward(self.grad_out), self.device)
        if timed_step:
            for name, t in times.items():
                self.phases[name].append(t)

    @contextlib.contextmanager
    def _counted(self, *, layer: bool) -> Iterator[None]:
        """The wire, once: on the phases' pass, or on the layer's for the mode without phases."""
        if self.wire is not None or layer != (self.name == "overlap"):
            yield
            return
        with WireCounter(self.args.hidden) as counter:
            yield
        self.wire = counter

    def result(self) -> dict[str, Any]:
        assert self.wire is not None
        wire = self.wire
        counts = [wire.rows, wire.rows_off_rank, wire.bytes, wire.bytes_off_rank]
        totals = torch.tensor(counts, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)  # every rank's sends
        rows, rows_off, sent_bytes, bytes_off = (int(v) for v in totals.tolist())
        # rows counted over dispatch, combine and both backwards: four hidden-state messages per step
        tokens_all = self.args.tokens * dist.get_world_size()
        median = {name: statistics.median(times) for name, times in self.phases.items()}
        return {
            "mode": self.name,
            "hidden_rows_per_message": rows / 4,
            "rows_per_token": rows / 4 / tokens_all,
            "rows_per_token_off_rank": rows_off / 4 / tokens_all,
            "bytes_per_step": sent_bytes,
            "bytes_per_step_off_rank": bytes_off,
            "median_s": median,
            # the exchange alone (its phases; none for the overlapped mode), and with the experts
            "total_s": sum(median[p] for p in EXCHANGE_PHASES if p in median),
            "layer_s": sum(median[p] for p in LAYER_PHASES),
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8 * 2048, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--intermediate", type=int, default=512, help="each expert's SwiGLU width")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 1 warm-up and 2 timed steps")
    parser.add_argument("--out", type=Path, help="write the results as JSON (rank 0)")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.experts, args.top_k, args.warmup, args.steps = 64, 32, 16, 4, 1, 2
        args.intermediate = 16
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    dtype = getattr(torch, args.dtype)
    ep = dist.get_world_size()
    names = args.modes.split(",")
    if unknown := set(names) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    modes = [Mode(args, name, device, dtype) for name in names]
    for step in range(args.warmup + args.steps):  # modes take turns, so drift on the machine hits both
        for mode in modes:
            mode.step(timed_step=step >= args.warmup)
    results = [mode.result() for mode in modes]
    if dist.get_rank() == 0:
        expected = expected_distinct_ranks(args.experts, ep, args.top_k)
        report = {
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
            "ep": ep,
            "torch": torch.__version__,
            "shape": {
                k: getattr(args, k) for k in ("tokens", "hidden", "intermediate", "experts", "top_k", "dtype")
            },
            "expected_distinct_ranks_per_token": expected,
            "results": results,
        }
        print(
            f"ep {ep} on {report['device']}: {args.tokens} tokens/rank, hidden {args.hidden}, "
            f"{args.experts} experts top-{args.top_k}, {args.dtype}; expected distinct ranks per token "
            f"{expected:.3f} (copies: {args.top_k})"
        )
        phases = (*EXCHANGE_PHASES, *LAYER_PHASES)
        columns = ["mode", "rows/token", "off-rank rows/token", "MB sent/step"]
        columns += [f"{p} ms" for p in phases] + ["layer ms"]
        print("| " + " | ".join(columns) + " |")
        print("|---" * len(columns) + "|")
        for r in results:
            m = r["median_s"]
            cells = [f"{m[p] * 1e3:.2f}" if p in m else "-" for p in phases]
            print(
                f"| {r['mode']} | {r['rows_per_token']:.3f} | {r['rows_per_token_off_rank']:.3f} | "
                f"{r['bytes_per_step'] / 1e6:.1f} | " + " | ".join(cells) + f" | {r['layer_s'] * 1e3:.2f} |"
            )
        if args.out is not None:
            args.out.write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
