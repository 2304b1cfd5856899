"""What a training rank reports per step: train metrics (rank 0), health (every rank), task metrics (the
rank that holds them), and the paused marker launchers read (see `d9d.engine.runtime`)."""

from __future__ import annotations

import time
from typing import Any

import psutil
import torch

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain
from d9d.engine.runtime import MetricPoint, RunReporter
from d9d.metrics import AsyncMetricCollector, to_scalars


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
        step_metrics: dict[str, float],
    ) -> None:
        self.ctx = ctx
        self.reporter = reporter
        self.period = period
        self.total_steps = total_steps
        self.collector = collector
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
    ) -> None:
        now = time.time()
        self.publish_task_metrics()
        if step % self.period != 0 and step != self.total_steps:
            return
        if self.collector is not None:
            self.collector.schedule(step, reset=True)
        if self.ctx.is_main_process:
            values = {"loss": loss, "lr": lr, "step_time_s": step_time}
            if grad_norm is not None:
                values["grad_norm"] = grad_norm
            if tokens_per_s is not None:
                values["tokens_per_s"] = tokens_per_s
            values.update(self.step_metrics)
            self.reporter.metrics(MetricPoint(step=step, rank=0, values=values, kind="train", wall_time=now))
        health = {"step_time_s": step_time, "rss_bytes": float(psutil.Process().memory_info().rss)}
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
