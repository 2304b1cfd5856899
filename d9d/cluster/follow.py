"""What `d9d train` shows while it waits: a progress bar on a terminal, `[d9d] ...` lines otherwise (the
lines `d9d status` picks the latest of from a Ray job's log)."""

from __future__ import annotations

import sys
from typing import TextIO

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from d9d.cluster.client import TrainingJob
from d9d.cluster.control.metrics import CLUSTER_RANK
from d9d.cluster.state import JobState, JobStatus, RunSummary
from d9d.engine.runtime import MetricPoint

PREFIX = "[d9d]"
# What a progress line shows of a train point when it has them (every value goes to the tracker).
SHOWN = ("loss", "lr", "grad_norm", "tokens_per_s")


class _Display:
    def __init__(self, total: int, out: TextIO, interactive: bool) -> None:
        self.out = out
        self.bar: Progress | None = None
        if interactive:
            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self.task = self.bar.add_task("train", total=total, info="")
            self.bar.start()

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(f"{PREFIX} {text}")
        else:
            print(f"{PREFIX} {text}", file=self.out, flush=True)

    def step(self, point: MetricPoint, total: int) -> None:
        info = " ".join(f"{k} {point.values[k]:.4g}" for k in SHOWN if k in point.values)
        if self.bar is not None:
            self.bar.update(self.task, completed=point.step, info=info)
        else:
            self.line(f"step {point.step}/{total} {info}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def follow(job: TrainingJob, out: TextIO = sys.stdout, interactive: bool | None = None) -> RunSummary:
    """Stream a started job's progress until it ends; return its summary."""
    total = job.spec.train.trainer.total_steps
    display = _Display(total, out, out.isatty() if interactive is None else interactive)
    last: JobStatus | None = None
    try:
        while True:
            points, ended = job.poll_metrics(1.0)
            for point in points:
                if point.kind == "train" and point.rank == 0:
                    display.step(point, total)
                elif point.rank == CLUSTER_RANK:
                    display.line(", ".join(f"{k} {v:.4g}" for k, v in point.values.items()))
            status = job.status()
            if last is None or status.state != last.state:
                text = f"run {status.run_name}: {status.state.value}"
                if status.state is JobState.RUNNING:
                    text += (
                        f" (attempt {status.attempt}, {status.world_size} ranks, dp {status.data_parallel})"
                    )
                if status.state is JobState.RESTARTING and status.last_failure:
                    text += f" after: {status.last_failure}"
                display.line(text)
            last = status
            if ended:
                break
    finally:
        display.close()
    summary = job.result()
    display.line(
        f"run {summary.run_name} {summary.status}: {summary.steps} steps, {summary.restarts} restarts, "
        f"final loss {summary.final_loss}, summary in {job.spec.run_dir / 'run_summary.json'}"
    )
    if summary.error:
        display.line(summary.error)
    return summary
