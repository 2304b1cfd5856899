"""Per-category GPU time of a training step from torch.profiler, so a regression shows where it lands.

Kernels are sorted into categories by name (first match wins; the order matters: a Triton kernel of a
fused loss is "loss" before it is "elementwise/reduce"). "idle gaps" is step wall time minus the union of
kernel intervals: launch gaps, host syncs and host-side work such as the data pipeline.
"""

from __future__ import annotations

from typing import Any

import torch

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # d9d's MoE permute (scatter_rows), combine (gather_sum) and routing-weight gradient (slot_dot) kernels
    ("moe token movement", ("_scatter_rows_kernel", "_gather_sum_kernel", "_slot_dot_kernel")),
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "alltoall")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("attention", ("flash", "fmha", "attention", "attn", "cudnn", "flex")),
    # d9d's chunked cross-entropy runs the Triton kernels `_rows_kernel` / `_grad_kernel`.
    (
        "loss",
        ("cross_entropy", "crossentropy", "nll_loss", "softmax", "logsumexp", "_rows_kernel", "_grad_kernel"),
    ),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "gemv", "grouped_mm", "wgmma", "sm90_", "mm_")),
    ("dtype copies", ("copy_kernel", "memcpy", "to_copy", "convert")),
)
OTHER = "elementwise/reduce"
IDLE = "idle gaps"


def categorize(kernel_name: str) -> str:
    name = kernel_name.lower()
    for category, needles in CATEGORIES:
        if any(n in name for n in needles):
            return category
    return OTHER


def _busy_union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def breakdown(prof: torch.profiler.profile, wall_s: float, steps: int) -> dict[str, Any]:
    """GPU time per category per step (ms) and share of the step, plus the ten heaviest kernels."""
    per_category = {name: 0.0 for name, _ in CATEGORIES} | {OTHER: 0.0}  # zeros shown too: a stable table
    per_kernel: dict[str, float] = {}
    calls: dict[str, int] = {}
    intervals: list[tuple[float, float]] = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, end = event.time_range.start, event.time_range.end  # microseconds
        intervals.append((start, end))
        per_category[categorize(event.name)] = per_category.get(categorize(event.name), 0.0) + end - start
        per_kernel[event.name] = per_kernel.get(event.name, 0.0) + end - start
        calls[event.name] = calls.get(event.name, 0) + 1
    busy_us = _busy_union(intervals)
    step_ms = wall_s * 1e3 / steps
    rows = {k: v / 1e3 / steps for k, v in per_category.items()}
    rows[IDLE] = max(step_ms - busy_us / 1e3 / steps, 0.0)
    heaviest = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    return {
        "step_ms": step_ms,
        "ms_per_step": dict(sorted(rows.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms_per_step": [
            (name[:120], us / 1e3 / steps, calls[name] // steps) for name, us in heaviest
        ],
    }


def render(report: dict[str, Any]) -> str:
    step = report["step_ms"]
    lines = [f"  GPU time per step (profiled wall {step:.1f} ms):"]
    for category, ms in report["ms_per_step"].items():
        lines.append(f"    {category:<20} {ms:8.2f} ms  {100 * ms / step:5.1f}%")
    lines.append("  heaviest kernels:")
    for name, ms, *count in report["top_kernels_ms_per_step"]:  # older result files have no call counts
        calls = f"{count[0]:5d}x" if count else "      "
        lines.append(f"    {ms:8.2f} ms {calls}  {name}")
    return "\n".join(lines)
