"""What a training rank reports per step: train metrics (rank 0), health (every rank), task metrics (the
rank that holds them), and the paused marker launchers read (see `d9d.engine.runtime`).

Throughput: `tokens_per_s` counts the positions the model processed (every non-padding input position of
the global batch, `d9d.engine.step.processed_positions`), `loss_tokens_per_s` the tokens the loss is taken
over (the loss weight: masked prompts and padding excluded). MFU (`mfu`, a fraction) is reported when the
model provider has the `ModelFlops` trait and the device's peak is known: processed tokens/s × FLOPs per
token ÷ (ranks × the device's dense bf16 peak). The sequence length the attention term needs is the step's
mean: processed positions ÷ sequences in the global batch.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain
from d9d.engine.providers import ModelFlops
from d9d.engine.runtime import MetricPoint, RunReporter, reports_train_metrics
from d9d.engine.step_metrics import StepMetrics
from d9d.metrics import AsyncMetricCollector, to_scalars

# Dense bf16 tensor-core peak FLOP/s by device name (the vendors' spec sheets, no sparsity); the first
# name the device's contains wins, so more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)


def device_peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None (CPU, an unknown GPU): then no MFU is reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


@dataclass(frozen=True)
class FlopsBudget:
    """What MFU needs: the model's FLOPs per token, sequences per optimizer step, and the peak FLOP/s of
    every device of the job together."""

    flops_per_token: Callable[[int], float]
    sequences_per_step: int
    peak_flops: float

    def mfu(self, tokens_per_s: float, step_time_s: float) -> float:
        """`tokens_per_s`: processed positions (padding excluded) per second, which the model computed on."""
        seq_len = max(1, round(tokens_per_s * step_time_s / self.sequences_per_step))
        return tokens_per_s * self.flops_per_token(seq_len) / self.peak_flops


def build_flops_budget(model: object, ctx: DistributedContext, global_batch_size: int) -> FlopsBudget | None:
    if not isinstance(model, ModelFlops):
        return None
    peak = device_peak_flops(ctx.device)
    if peak is None:
        return None
    return FlopsBudget(model.flops_per_token, global_batch_size, peak * ctx.world_size)


def peak_rss_bytes() -> float:
    """This process's resident-memory high-water mark (what the console shows as `rss` on CPU ranks)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


class StepReporter:
    def __init__(
        self,
        ctx: DistributedContext,
        reporter: RunReporter,
        *,
        period: int,
        total_steps: int,
        collector: AsyncMetricCollector[Any] | None,
        loss_pp_rank: int,
        step_metrics: StepMetrics,
        flops: FlopsBudget | None = None,
    ) -> None:
        self.ctx = ctx
        self.reporter = reporter
        self.period = period
        self.total_steps = total_steps
        self.collector = collector
        self.flops = flops
        # Values that event subscribers (e.g. MoE load balancing) record during a step, logged with it.
        self.step_metrics = step_metrics
        # Task metrics live where losses are computed: the data-rank-0 copy of the last stage writes them.
        coords = ctx.coordinates(MeshDomain.BATCH)
        self.writes_task_metrics = (
            coords["pp"] == loss_pp_rank and coords["dp"] == 0 and coords["cp"] == 0 and coords["tp"] == 0
        )

    def step(
        self,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
        step_time: float,
        tokens_per_s: float | None,
        loss_tokens_per_s: float | None = None,
    ) -> None:
        """`tokens_per_s`: the positions the model processed (padding excluded) per second, which MFU
        counts; `loss_tokens_per_s`: the tokens the loss is taken over per second."""
        now = time.time()
        self.publish_task_metrics()
        if not reports_train_metrics(step, self.period, self.total_steps):
            return
        if self.collector is not None:
            self.collector.schedule(step, reset=True)
        if self.ctx.is_main_process:
            values = {"loss": loss, "lr": lr, "step_time_s": step_time}
            if grad_norm is not None:
                values["grad_norm"] = grad_norm
            if tokens_per_s is not None:
                values["tokens_per_s"] = tokens_per_s
                if self.flops is not None:
                    values["mfu"] = self.flops.mfu(tokens_per_s, step_time)
            if loss_tokens_per_s is not None:
                values["loss_tokens_per_s"] = loss_tokens_per_s
            self.step_metrics.resolve()
            values.update(self.step_metrics)
            self.reporter.metrics(MetricPoint(step=step, rank=0, values=values, kind="train", wall_time=now))
        health = {
            "step_time_s": step_time,
            "rss_bytes": float(psutil.Process().memory_info().rss),
            "peak_rss_bytes": peak_rss_bytes(),
        }
        if self.ctx.device.type == "cuda":
            health["cuda_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated(self.ctx.device))
        self.reporter.metrics(
            MetricPoint(step=step, rank=self.ctx.rank, values=health, kind="health", wall_time=now)
        )

    def publish_task_metrics(self, wait: bool = False) -> None:
        if self.collector is None:
            return
        for step, value in self.collector.results(wait=wait):
            if self.writes_task_metrics:
                values = to_scalars(value, prefix="task")
                self.reporter.metrics(
                    MetricPoint(step=step, rank=self.ctx.rank, values=values, wall_time=time.time())
                )

    def finish(self) -> None:
        """Publish the last window of task metrics and stop the collector's thread."""
        if self.collector is not None:
            self.publish_task_metrics(wait=True)
            self.collector.close()

    def paused(self, step: int) -> None:
        """`health/rank0/paused` = 1 at the step where the ranks really stopped, which is what a launcher's
        status should say (not when the command was sent). Resuming is not reported: it happens at the
        same step, and a tracker keeps one value per step."""
        if self.ctx.is_main_process:
            self.reporter.metrics(MetricPoint(step, 0, {"paused": 1.0}, "health", time.time()))
