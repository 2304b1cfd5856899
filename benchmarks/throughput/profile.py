"""Where the time of a training step goes, from torch.profiler, so a regression shows where it lands.

Used by `train_throughput.py --profile` (1 GPU, GPU activity only) and `multi_gpu.py --profile` (every rank,
CPU and GPU activity; the probe of `throughput/probe.py` profiles and `across_ranks` sums the ranks up).

Work intervals. On CUDA: every device activity (kernels, memcpys, memsets) of the profiled steps. Without
device activity (CPU ranks on gloo, the smoke runs): the CPU ops that contain no other op on their thread,
a collective counting as one interval (its own packing ops inside it are communication, not compute).

Categories: each interval is sorted by name (first match wins; the order matters: a Triton kernel of a fused
loss is "loss" before it is "elementwise/reduce"). The communication categories are split by collective:
NCCL kernels are named `ncclDevKernel_AllGather_…`, `…_ReduceScatter_…`, `…_AllReduce_…`, `…_Broadcast_…`;
`all_to_all_single` runs as grouped sends and receives in NCCL, one `ncclDevKernel_SendRecv` kernel, so that
category is "send/recv (p2p or all-to-all)" (an expert-parallel row has no other point-to-point traffic; a
pipeline row has both). Gloo records CPU ops such as `c10d::alltoall_base_` (the issuing call) and
`gloo:all_to_all` (the transfer, on gloo's own thread). A category's time is the sum of its intervals' time.

Busy time (interval unions, so overlapping intervals count once):
- compute: the union of the non-communication intervals; communication: the union of the communication ones;
- exposed communication: communication time with no compute interval running (communication ∖ compute);
- idle: step wall time with no interval at all (wall − compute − exposed communication): launch gaps, host
  syncs, host-side work such as the data pipeline, and, on the profiled steps, the profiler's own overhead.
  compute + exposed communication + idle = the step (idle is clamped at 0 where the intervals overrun the
  host-timed window).

Host syncs (needs CPU activity): host time blocked on the device. The intervals of the blocking CUDA
runtime calls (`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`, `cudaMemcpy`), of a
`cudaMemcpyAsync` that the same op synchronizes right after (PyTorch's blocking device→host copy: `.cpu()`,
`.tolist()`, `.item()`; to pageable memory the copy call itself blocks); their union per thread, one sync
per merged interval. Each sync is named by the innermost op around it on its thread
(`aten::_local_scalar_dense` for `.item()`, `aten::copy_` for `.cpu()` / `.tolist()`, `aten::nonzero`, ...).
An `.item()` of a CPU tensor makes no such call and is no sync (metrics code calls it by the hundred per
step); on CPU ranks nothing is (there is no device to wait for).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

COMMUNICATION: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("all-to-all", ("alltoall", "all_to_all")),
    (
        "send/recv (p2p or all-to-all)",
        ("sendrecv", "send_recv", "c10d::send", "c10d::recv", "gloo:send", "gloo:recv"),
    ),
    ("all-gather", ("allgather", "all_gather")),
    ("reduce-scatter", ("reducescatter", "reduce_scatter")),
    ("all-reduce", ("allreduce", "all_reduce")),
    ("broadcast", ("broadcast",)),
    ("communication (other)", ("nccl", "c10d::", "gloo:")),
)
COMMUNICATION_CATEGORIES = frozenset(name for name, _ in COMMUNICATION)
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # d9d's MoE permute (scatter_rows), combine (gather_sum) and routing-weight gradient (slot_dot) kernels
    ("moe token movement", ("_scatter_rows_kernel", "_gather_sum_kernel", "_slot_dot_kernel")),
    *COMMUNICATION,
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("attention", ("flash", "fmha", "attention", "attn", "cudnn", "flex")),
    # d9d's chunked cross-entropy runs the Triton kernels `_rows_kernel` / `_grad_kernel`.
    (
        "loss",
        ("cross_entropy", "crossentropy", "nll_loss", "softmax", "logsumexp", "_rows_kernel", "_grad_kernel"),
    ),
    # (the `aten::` names: CPU ranks, whose work is ops, not kernels)
    (
        "matmul",
        (
            *("gemm", "cutlass", "xmma", "nvjet", "cublas", "gemv", "grouped_mm", "wgmma", "sm90_", "mm_"),
            *("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
        ),
    ),
    ("dtype copies", ("copy_kernel", "memcpy", "to_copy", "convert")),
)
OTHER = "elementwise/reduce"
IDLE = "idle gaps"
# The busy-time keys of a report, in the order they are shown.
COMPUTE, COMM, EXPOSED, BUSY_IDLE = "compute", "communication", "exposed communication", "idle"

SYNC_CALLS = frozenset(
    {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
)
ASYNC_COPY = "cudaMemcpyAsync"


def categorize(kernel_name: str) -> str:
    name = kernel_name.lower()
    if name.startswith("fsdp::"):  # FSDP's copy-in/out ops (CPU ranks) name a collective but copy
        return "dtype copies"
    for category, needles in CATEGORIES:
        if any(n in name for n in needles):
            return category
    return OTHER


# ---- interval arithmetic (any unit; intervals are (start, end) with start <= end) ----


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same points (touching intervals join)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(end - start for start, end in merge(intervals))


def overlap_length(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """Length of (∪a) ∩ (∪b): a sweep over both merged lists."""
    xs, ys = merge(a), merge(b)
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(hi - lo, 0.0)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---- the profiler's events ----


@dataclass(frozen=True)
class Event:
    """One profiler event, times in microseconds. `thread`: the host thread of a CPU event (the system id,
    Kineto's resource id: the same for ops and CUDA runtime calls), the stream of a device event."""

    name: str
    start: float
    end: float
    thread: int = 0
    device: bool = False
    correlation: int = 0  # a device event: the launching runtime call's; a runtime call: its own (0: none)


def events_of(prof: torch.profiler.profile) -> list[Event]:
    """The events of a stopped profiler, read from Kineto's results directly: `prof.events()` would first
    build the op tree in Python, which takes minutes on a few steps of a large model."""
    out = []
    for e in prof.profiler.kineto_results.events():  # type: ignore[union-attr]
        if e.is_user_annotation():
            continue  # `record_function` ranges and their GPU-side spans (both kinds answer here): not work
        start = e.start_ns() / 1e3
        device = e.device_type() != torch.autograd.DeviceType.CPU
        out.append(
            Event(
                e.name(),
                start,
                start + e.duration_ns() / 1e3,
                e.device_resource_id(),
                device,
                e.linked_correlation_id() if device else e.correlation_id(),
            )
        )
    return out


def _by_thread(events: Iterable[Event]) -> dict[int, list[Event]]:
    threads: dict[int, list[Event]] = {}
    for e in events:
        threads.setdefault(e.thread, []).append(e)
    for thread in threads.values():
        thread.sort(key=lambda e: (e.start, -e.end))  # a parent before its children
    return threads


def _parents(events: Sequence[Event]) -> list[int]:
    """The innermost enclosing event of each (index into `events`, sorted as `_by_thread` does; -1: none)."""
    parents, stack = [], []
    for i, e in enumerate(events):
        while stack and events[stack[-1]].end < e.end:
            stack.pop()
        parents.append(stack[-1] if stack else -1)
        stack.append(i)
    return parents


def work_intervals(events: Sequence[Event]) -> tuple[str, list[Event]]:
    """What counts as work (module docs): the device activities, else the leaf CPU ops (collectives whole)."""
    device = [e for e in events if e.device]
    if device:
        return "cuda kernels", device
    work: list[Event] = []
    for thread in _by_thread(e for e in events if not e.device).values():
        parents = _parents(thread)
        has_child = {p for p in parents if p >= 0}
        in_collective = [False] * len(thread)
        for i, e in enumerate(thread):
            p = parents[i]
            in_collective[i] = p >= 0 and (
                in_collective[p] or categorize(thread[p].name) in COMMUNICATION_CATEGORIES
            )
            if in_collective[i]:
                continue
            if categorize(e.name) in COMMUNICATION_CATEGORIES or i not in has_child:
                work.append(e)
    return "cpu ops", work


def host_syncs(events: Sequence[Event]) -> list[tuple[str, float, float]]:
    """Each host sync (module docs) as (name, start, end)."""
    syncs = []
    for thread in _by_thread(e for e in events if not e.device).values():
        parents = _parents(thread)
        spans: list[tuple[float, float, int]] = []  # (start, end, index of the event that names it)
        last_call = -1  # the thread's previous CUDA runtime call
        for i, e in enumerate(thread):
            if e.name in SYNC_CALLS:
                # the copy half of one blocking copy: the same op issued both calls
                copy = None
                if (
                    last_call >= 0
                    and thread[last_call].name == ASYNC_COPY
                    and parents[last_call] == parents[i]
                ):
                    copy = thread[last_call]
                spans.append((copy.start if copy else e.start, e.end, i))
            if e.name.startswith("cu"):
                last_call = i
        merged: list[tuple[float, float, int]] = []
        for start, end, i in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]), merged[-1][2])
            else:
                merged.append((start, end, i))
        for start, end, i in merged:
            # a runtime call is named by the op it runs in
            p = parents[i]
            while p >= 0 and thread[p].name.startswith("cu"):
                p = parents[p]
            syncs.append((thread[p if p >= 0 else i].name, start, end))
    return syncs


def idle_gap_sites(events: Sequence[Event], steps: int, min_us: float = 20.0, top: int = 15) -> list[Any]:
    """Where the device waits on the host: each gap of at least `min_us` between the device's busy intervals,
    summed by what ended it, as (site, ms per step, gaps per step), heaviest first. A gap ends when the
    host launches the next device activity: with host activity recorded (`--profile-ops`), the site is
    the innermost Python frame of d9d or the benchmark around that launch (with `with_stack`), else the
    innermost op, then that op's name; without it, the kernels before and after the gap. Host recording
    slows the host, so these gaps are longer than an unprofiled step's: read the sites, not the sizes."""
    device = sorted((e for e in events if e.device), key=lambda e: e.start)
    runtime: dict[int, tuple[list[Event], list[int], int]] = {}
    for thread in _by_thread(e for e in events if not e.device).values():
        parents = _parents(thread)
        for i, e in enumerate(thread):
            if e.correlation:
                runtime[e.correlation] = (thread, parents, i)

    def site_of(launched: Event, before: Event) -> str:
        found = runtime.get(launched.correlation)
        if found is None:
            return f"{before.name[:50]} -> {launched.name[:50]}"
        thread, parents, i = found
        op, frame = "", ""
        p = parents[i]
        while p >= 0:
            name = thread[p].name
            if not op and not name.startswith("cu") and ".py(" not in name:
                op = name
            if ".py(" in name and ("d9d/" in name or "benchmarks/" in name or "throughput/" in name):
                frame = name
                break
            p = parents[p]
        return f"{frame or '(no d9d frame)'} | {op or thread[i].name}"

    sites: dict[str, list[float]] = {}
    busy_end: Event | None = None
    for e in device:
        if busy_end is not None and e.start - busy_end.end >= min_us:
            site = sites.setdefault(site_of(e, busy_end), [0.0, 0.0])
            site[0] += (e.start - busy_end.end) / 1e3 / steps
            site[1] += 1 / steps
        if busy_end is None or e.end > busy_end.end:
            busy_end = e
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return [(name[:160], ms, n) for name, (ms, n) in ranked]


# ---- a report ----


def breakdown(prof: torch.profiler.profile, wall_s: float, steps: int, top: int = 15) -> dict[str, Any]:
    return breakdown_events(events_of(prof), wall_s, steps, top)


def breakdown_events(events: Sequence[Event], wall_s: float, steps: int, top: int = 15) -> dict[str, Any]:
    """Per step (ms) over `steps` profiled steps of `wall_s` seconds: time per category, busy time (compute,
    communication, exposed communication, idle), host syncs, and the `top` heaviest kernels (or ops)."""
    source, work = work_intervals(events)
    per_category = {name: 0.0 for name, _ in CATEGORIES} | {OTHER: 0.0}  # zeros shown too: a stable table
    per_kernel: dict[str, float] = {}
    calls: dict[str, int] = {}
    compute: list[tuple[float, float]] = []
    comm: list[tuple[float, float]] = []
    for e in work:
        category = categorize(e.name)
        per_category[category] += e.end - e.start
        per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.end - e.start
        calls[e.name] = calls.get(e.name, 0) + 1
        (comm if category in COMMUNICATION_CATEGORIES else compute).append((e.start, e.end))
    step_ms = wall_s * 1e3 / steps

    def ms(us: float) -> float:
        return us / 1e3 / steps

    compute_ms, comm_ms = ms(union_length(compute)), ms(union_length(comm))
    exposed_ms = comm_ms - ms(overlap_length(comm, compute))
    idle_ms = max(step_ms - compute_ms - exposed_ms, 0.0)
    rows = {k: ms(v) for k, v in per_category.items()}
    rows[IDLE] = idle_ms
    syncs = host_syncs(events)
    by_site: dict[str, list[float]] = {}
    for name, start, end in syncs:
        site = by_site.setdefault(name, [0.0, 0.0])
        site[0] += 1 / steps
        site[1] += ms(end - start)
    heaviest = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {
        "source": source,
        "steps": steps,
        "step_ms": step_ms,
        "ms_per_step": dict(sorted(rows.items(), key=lambda kv: -kv[1])),
        "busy_ms_per_step": {COMPUTE: compute_ms, COMM: comm_ms, EXPOSED: exposed_ms, BUSY_IDLE: idle_ms},
        "host_syncs": {
            "ms_per_step": sum(ms(end - start) for _, start, end in syncs),
            "per_step": len(syncs) / steps,
            "by_site": dict(sorted(by_site.items(), key=lambda kv: -kv[1][1])),  # name: [per step, ms]
        },
        "top_kernels_ms_per_step": [(name[:120], ms(us), calls[name] // steps) for name, us in heaviest],
        "idle_gap_sites": idle_gap_sites(events, steps),
    }


def render(report: dict[str, Any]) -> str:
    step = report["step_ms"]
    lines = [f"  GPU time per step (profiled wall {step:.1f} ms):"]
    for category, ms in report["ms_per_step"].items():
        lines.append(f"    {category:<30} {ms:8.2f} ms  {100 * ms / step:5.1f}%")
    lines.append("  heaviest kernels:")
    for name, ms, *count in report["top_kernels_ms_per_step"]:  # older result files have no call counts
        calls = f"{count[0]:5d}x" if count else "      "
        lines.append(f"    {ms:8.2f} ms {calls}  {name}")
    gaps = report.get("idle_gap_sites") or []  # older result files have none
    if gaps:
        lines.append("  idle gaps >= 20 us, by what ended them (ms per step, gaps per step):")
        for name, ms, n in gaps:
            lines.append(f"    {ms:8.2f} ms {n:6.1f}x  {name}")
    return "\n".join(lines)


# ---- across ranks ----


def across_ranks(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per number of the per-rank reports: mean, max and the rank that has the max (a report's `rank`, else
    its position)."""
    ranks = [int(r.get("rank", i)) for i, r in enumerate(reports)]

    def _spread(values: Sequence[float]) -> dict[str, Any]:
        top = max(range(len(values)), key=lambda i: values[i])
        return {"mean": statistics.fmean(values), "max": values[top], "max_rank": ranks[top]}

    syncs = [r["host_syncs"] for r in reports]
    return {
        "step_ms": _spread([r["step_ms"] for r in reports]),
        "busy_ms_per_step": {
            key: _spread([r["busy_ms_per_step"][key] for r in reports])
            for key in reports[0]["busy_ms_per_step"]
        },
        "host_syncs": {
            "ms_per_step": _spread([s["ms_per_step"] for s in syncs]),
            "per_step": _spread([s["per_step"] for s in syncs]),
        },
        "ms_per_step": {
            key: _spread([r["ms_per_step"].get(key, 0.0) for r in reports])
            for key in reports[0]["ms_per_step"]
        },
    }


def render_ranks(summary: dict[str, Any]) -> str:
    """A row's multi-rank profile (`multi_gpu.py`'s `profile` entry) as a text table: ms per step, with the
    share of the step for the mean."""
    ranks: list[dict[str, Any]] = summary["ranks"]
    spread = summary["across_ranks"]
    step = spread["step_ms"]["mean"]
    head = f"    {'ms per step':<32} {'mean':>8} {'share':>6} {'max':>8} {'@rank':>5} " + " ".join(
        f"{'r' + str(r['rank']):>8}" for r in ranks
    )
    lines = [head]

    def line(label: str, s: dict[str, Any], per_rank: list[float], share: bool = True) -> None:
        pct = f"{100 * s['mean'] / step:5.1f}%" if share and step > 0 else " " * 6
        lines.append(
            f"    {label:<32} {s['mean']:8.2f} {pct} {s['max']:8.2f} {s['max_rank']:>5} "
            + " ".join(f"{v:8.2f}" for v in per_rank)
        )

    line("step (wall)", spread["step_ms"], [r["step_ms"] for r in ranks])
    for key, s in spread["busy_ms_per_step"].items():
        line(f"{key} busy" if key in (COMPUTE, COMM) else key, s, [r["busy_ms_per_step"][key] for r in ranks])
    line("host syncs", spread["host_syncs"]["ms_per_step"], [r["host_syncs"]["ms_per_step"] for r in ranks])
    counts = [r["host_syncs"]["per_step"] for r in ranks]
    line("host syncs (count per step)", spread["host_syncs"]["per_step"], counts, share=False)
    lines.append("    by category (categories at 0 on every rank left out):")
    for key, s in spread["ms_per_step"].items():
        if s["max"] > 0:
            line(f"  {key}", s, [r["ms_per_step"].get(key, 0.0) for r in ranks])
    for r in ranks:
        sites = r["host_syncs"]["by_site"]
        if sites:
            text = ", ".join(f"{name} {n:.1f}x {ms:.2f} ms" for name, (n, ms) in list(sites.items())[:4])
            lines.append(f"    rank {r['rank']} host syncs per step: {text}")
    if summary.get("slowest_rank_per_step"):
        lines.append(
            f"    slowest rank per timed step: {' '.join(map(str, summary['slowest_rank_per_step']))}"
        )
    top = ranks[0].get("top_kernels_ms_per_step") or []
    if top:
        lines.append(f"    rank {ranks[0]['rank']} heaviest ({ranks[0]['source']}):")
        for name, ms, count in top:
            lines.append(f"      {ms:8.2f} ms {count:5d}x  {name}")
    return "\n".join(lines)
