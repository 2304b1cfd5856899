"""What `d9d train` shows while it waits, and where everything is when the run ends.

One line per logging period, from the coordinator's stream of rank 0's train points: step/total, loss, lr,
grad norm, tokens/s, MFU, peak memory over all ranks, elapsed time and ETA. On a terminal the line sits
beside a rich progress bar; rank actors write their output to `<run dir>/logs/rank<r>.log` (see
`d9d.cluster.rank`), so nothing else prints into the bar. Off a terminal each line is printed as
`[d9d] step 12/100 | ...` (the lines `d9d status` picks the latest of from a Ray job's log).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from d9d.cluster.client import TrainingJob
from d9d.cluster.control.metrics import CLUSTER_RANK
from d9d.cluster.control.startup import LABELS, PHASES, describe
from d9d.cluster.overview import format_duration as format_duration
from d9d.cluster.rank import RANK_LOG_DIR
from d9d.cluster.spec import JobSpec, tracker_config
from d9d.cluster.state import JobState, JobStatus, RunSummary
from d9d.engine.runtime import MetricPoint
from d9d.tracking import tracker_locations
from d9d.tracking.history import HISTORY_FILE
from d9d.tracking.plot import PLOT_FILE

PREFIX = "[d9d]"
RESUMED_FROM_KEY = "resumed_from"  # a cluster point marking a resume (d9d.cluster.control.controller)
# Health values a rank's memory high-water mark is taken from: device memory when there is a device, else
# the host's resident memory (its peak, or the largest sample seen).
DEVICE_MEMORY = ("cuda_max_allocated_bytes",)
HOST_MEMORY = ("peak_rss_bytes", "rss_bytes")


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.0f} KiB"


# The progress line's fields a narrow terminal leaves out, in this order (loss, ETA and step go last).
DROP_ORDER = ("mem", "rss", "MFU", "grad", "lr", "elapsed", "tok/s", "ETA", "loss")
_BAR_WIDTH = 40  # of the bar on a terminal of 100 columns or more; narrower ones get a shorter bar


@dataclass(frozen=True)
class ProgressLine:
    """What the console shows of one logging period; `fields()` are its labelled parts, in order."""

    step: int
    total: int
    elapsed_s: float
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None  # a fraction of the devices' peak FLOP/s
    peak_memory_bytes: float | None = None
    memory_is_device: bool = True
    eta_s: float | None = None

    def fields(self) -> dict[str, str]:
        out = {"step": f"{self.step}/{self.total}"}
        if self.loss is not None:
            out["loss"] = f"{self.loss:.4f}"
        if self.lr is not None:
            out["lr"] = f"{self.lr:.2e}"
        if self.grad_norm is not None:
            out["grad"] = f"{self.grad_norm:.3g}"
        if self.tokens_per_s is not None:
            out["tok/s"] = f"{self.tokens_per_s:,.0f}"
        if self.mfu is not None:
            out["MFU"] = f"{100 * self.mfu:.1f}%"
        if self.peak_memory_bytes is not None:
            out["mem" if self.memory_is_device else "rss"] = format_bytes(self.peak_memory_bytes)
        out["elapsed"] = format_duration(self.elapsed_s)
        out["ETA"] = "?" if self.eta_s is None else format_duration(self.eta_s)
        return out

    def text(self, with_step: bool = True) -> str:
        return " | ".join(f"{k} {v}" for k, v in self.fields().items() if with_step or k != "step")

    def fit(self, width: int, with_step: bool = True) -> str:
        """`text()` within `width` characters: whole fields are left out, the least telling first
        (`DROP_ORDER`), never cut in the middle."""
        fields = {k: v for k, v in self.fields().items() if with_step or k != "step"}
        for name in DROP_ORDER:
            text = " | ".join(f"{k} {v}" for k, v in fields.items())
            if len(text) <= width:
                return text
            fields.pop(name, None)
        return " | ".join(f"{k} {v}" for k, v in fields.items())[: max(width, 0)]


class ConsoleProgress:
    """Turns the metric stream into `ProgressLine`s: keeps every rank's memory high-water mark and the step
    rate since the first step this console saw (start-up and compilation are not in the ETA)."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self._clock = clock
        self._start = clock()
        self._first: tuple[float, int] | None = None  # (time, step) of the first train point seen
        self._device_peak: dict[int, float] = {}
        self._host_peak: dict[int, float] = {}

    def observe(self, point: MetricPoint) -> ProgressLine | None:
        """Take any point; return the line to show when it is rank 0's train point."""
        if point.kind == "health" and point.rank >= 0:
            for keys, peaks in ((DEVICE_MEMORY, self._device_peak), (HOST_MEMORY, self._host_peak)):
                for key in keys:
                    if key in point.values:
                        peaks[point.rank] = max(peaks.get(point.rank, 0.0), point.values[key])
            return None
        if point.kind != "train" or point.rank != 0 or "loss" not in point.values:
            return None
        now = self._clock()
        if self._first is None:
            self._first = (now, point.step)
        eta = None
        first_time, first_step = self._first
        if point.step > first_step and now > first_time:
            per_step = (now - first_time) / (point.step - first_step)
            eta = per_step * max(0, self.total - point.step)
        values = point.values
        device = bool(self._device_peak)
        peaks = self._device_peak if device else self._host_peak
        return ProgressLine(
            step=point.step,
            total=self.total,
            elapsed_s=now - self._start,
            loss=values.get("loss"),
            lr=values.get("lr"),
            grad_norm=values.get("grad_norm"),
            tokens_per_s=values.get("tokens_per_s"),
            mfu=values.get("mfu"),
            peak_memory_bytes=max(peaks.values()) if peaks else None,
            memory_is_device=device,
            eta_s=eta,
        )

    @property
    def first(self) -> tuple[float, int] | None:
        """(time, step) of the first train point seen, None before it."""
        return self._first

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._start


class _Display:
    def __init__(self, total: int, out: TextIO, interactive: bool, console: Console | None = None) -> None:
        self.out = out
        self.total = total
        self.bar: Progress | None = None
        if interactive:
            console = console or Console()
            self.bar_width = _BAR_WIDTH if console.width >= 100 else max(10, console.width // 5)
            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=self.bar_width),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                console=console,
                redirect_stdout=True,  # the driver's own prints (Ray's warnings) go above the bar
                redirect_stderr=True,
            )
            self.task = self.bar.add_task("train", total=total, info="")
            self.bar.start()

    def info_width(self) -> int:
        """Columns left for the fields beside the label, the bar and the step count (one space apart)."""
        assert self.bar is not None
        steps = 2 * len(str(self.total)) + 1
        return self.bar.console.width - (len("train") + self.bar_width + steps + 3)

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(f"{PREFIX} {text}", markup=False, highlight=False)
        else:
            print(f"{PREFIX} {text}", file=self.out, flush=True)

    def step(self, line: ProgressLine) -> None:
        if self.bar is not None:
            info = line.fit(self.info_width(), with_step=False)
            self.bar.update(self.task, completed=line.step, info=info)
        else:
            self.line(line.text())

    def starting(self, phase: str, seconds: float) -> None:
        """The start-up phase in progress, beside the bar (off a terminal each phase's line says it)."""
        if self.bar is not None:
            info = f"starting: {LABELS.get(phase, phase)} ({format_duration(seconds)})"
            self.bar.update(self.task, info=info[: max(self.info_width(), 0)])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def where_everything_is(spec: JobSpec) -> list[str]:
    """The lines printed at the end of a run: each tracker and the command that opens it, checkpoints,
    summary, plot, history and rank logs (those that exist)."""
    run_dir = spec.run_dir
    lines = []
    for loc in tracker_locations(tracker_config(spec), run_dir):
        lines.append(f"{loc.kind + ':':13}{loc.command or loc.where}")
    rows = (
        ("checkpoints:", spec.checkpoint_dir),
        ("summary:", spec.storage_root / "run_summary.json"),
        ("plot:", run_dir / PLOT_FILE),
        ("history:", run_dir / HISTORY_FILE),
    )
    lines += [f"{label:13}{path}" for label, path in rows if path.exists()]
    logs = run_dir / RANK_LOG_DIR
    if any(logs.glob("rank*.log")):
        lines.append(f"{'rank logs:':13}{logs}/rank<r>.log")
    if spec.train.run.storage is not None:  # copies of the tracker files, history, plot and logs
        lines.append(f"{'storage:':13}{spec.storage_root}")
    return lines


def follow(job: TrainingJob, out: TextIO | None = None, interactive: bool | None = None) -> RunSummary:
    """Stream a started job's progress until it ends (to `out`, default: stdout as it is now); return its
    summary."""
    out = sys.stdout if out is None else out
    total = job.spec.train.trainer.total_steps
    display = _Display(total, out, out.isatty() if interactive is None else interactive)
    progress = ConsoleProgress(total)
    last: JobStatus | None = None
    said = 0  # notices printed
    phases = 0  # start-up phases printed
    try:
        while True:
            points, ended = job.poll_metrics(1.0, as_received=True)
            status = job.status()  # after the points: its start-up has the phase their first step ended
            for phase, seconds in status.startup[phases:]:
                display.line(f"start-up: {LABELS.get(phase, phase)} {seconds:.1f}s")
                if phase == PHASES[-1]:
                    display.line(f"started in {describe(dict(status.startup))}")
            phases = len(status.startup)
            if status.starting is not None and progress.first is None:
                display.starting(status.starting[0], max(0.0, time.time() - status.starting[1]))
            # A step's health points update the memory shown on that step's line.
            for point in sorted(points, key=lambda p: p.kind != "health"):
                line = progress.observe(point)
                if line is not None:
                    display.step(line)
                elif point.rank == CLUSTER_RANK and RESUMED_FROM_KEY not in point.values:
                    # (a resume's mark is said by the coordinator's notice, with its checkpoint)
                    display.line(", ".join(f"{k} {v:.4g}" for k, v in point.values.items()))
            fresh = status.notice_count - said
            for notice in (
                status.notices[len(status.notices) - min(fresh, len(status.notices)) :] if fresh else ()
            ):
                display.line(notice)
            said = status.notice_count
            if status.failures > (last.failures if last is not None else 0) and status.last_failure:
                # As it happens, even when the restart is over before this poll saw it.
                display.line(f"attempt failed: {status.last_failure}")
            if last is None or status.state != last.state or status.asleep != last.asleep:
                text = f"run {status.run_name}: {status.state.value}"
                if status.asleep:
                    text += " (asleep: training state in host memory)"
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
    loss = "n/a" if summary.final_loss is None else f"{summary.final_loss:.4f}"
    display.line(
        f"run {summary.run_name} {summary.status}: {summary.steps}/{total} steps, "
        f"{summary.restarts} restarts, final loss {loss}, elapsed {format_duration(progress.elapsed_s)}"
    )
    if summary.error:
        display.line(summary.error)
    if job.coordinator_lost:
        print(f"d9d: {summary.error}", file=sys.stderr, flush=True)
    for where in where_everything_is(job.spec):
        display.line(f"  {where}")
    return summary
