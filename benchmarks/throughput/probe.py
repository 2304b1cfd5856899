"""Per-rank timings of an engine-driven benchmark row, written where the benchmark's parent reads them.

The probe lives in every rank process, whichever launcher started it (`torchrun -m d9d.engine.launch` or the
Ray rank actors of `d9d train`): the benchmark's data provider (`throughput.data:RandomTokens` with
`probe_dir`) installs it from `setup()`, so nothing in the engine or in the launchers is changed for it.
It records, on its rank:

- the wall time of every step: from one `next_step()` call of the data provider (the first thing the
  engine does in a step) to the next; everything a rank does per step is inside (forward, backward,
  gradient sync, optimizer, reporting);
- the allocator's peak per step (CUDA only): read and reset at each `next_step()`;
- on pipeline-parallel jobs, every stage pass (`StageRuntime.forward`, `.backward` full or input-only,
  `.backward_weight`) and the span of the rank's whole pipeline program (`PipelineExecutor.train_step`):
  CUDA events on the current stream (GPU time), or host clocks on CPU. A pass is timed from after its
  inputs arrived (the executor takes them before it calls the stage), so waiting for a neighbour falls
  outside every pass and inside the span. What this gives the benchmark is documented in
  `benchmarks/multi_gpu.py` (the bubble).

- with `profile_from` set (`multi_gpu.py --profile`): torch.profiler over `profile_steps` steps from that
  step on (CPU activity, and CUDA where the rank uses a GPU), after one profiler warm-up step before them
  (the profiler's documented warm-up: its start-up cost stays out of the profiled steps). The device is
  synchronized at the window's edges, so the window holds exactly the work of its steps; the per-rank
  breakdown of `throughput/profile.py` goes to `rank<r>_profile.json` (with `profile_trace`, each rank also
  exports its Chrome trace, gzipped, `rank<r>_trace.json.gz`: the slow rank is the one to read). The
  profiler slows the steps it records: `multi_gpu.py` puts the window after the timed steps.

The file `rank<r>.json` is rewritten at every step (a few kilobytes; the write sits between two steps),
because a Ray rank actor may be ended without running exit handlers.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_installed: RankProbe | None = None


class _Clock:
    """CUDA events on the current stream when the process uses a GPU, else the host clock (CPU ranks run
    their ops synchronously, so host time is compute time)."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        return float(end - start)


class RankProbe:
    """One rank's record (`rank<r>.json`), keyed by step (1-based; a step is recorded once the next begins):

    - `step_s`: wall seconds of the step; `peak_gib`: the allocator's peak during it (None on CPU);
    - `pipeline`: per step, `span_s` (the rank's pipeline program) and `passes` [(kind, stage, seconds)],
      kind F (forward), B (full backward), I (input-gradient backward), W (weight-gradient backward).
    """

    def __init__(self, out_dir: Path, rank: int, profiling: ProfileWindow | None = None) -> None:
        self.path = out_dir / f"rank{rank}.json"
        self.profiling = profiling
        self._prof: torch.profiler.profile | None = None
        self._window_started = 0.0
        self.rank = rank
        self.clock: _Clock | None = None
        self.device = "cpu"
        self.step = 0
        self.started = 0.0
        self.step_s: dict[int, float] = {}
        self.peak_gib: dict[int, float | None] = {}
        self.pipeline: dict[int, dict[str, Any]] = {}
        self._span: tuple[Any, Any] | None = None
        self._marks: list[tuple[str, int, Any, Any]] = []

    # -- hooks --------------------------------------------------------------------------------------

    def step_started(self) -> None:
        now = time.perf_counter()
        if self.clock is None:  # the first step: CUDA (if used) is initialized by now
            self.clock = _Clock()
            if self.clock.cuda:
                self.device = torch.cuda.get_device_name()
        if self.step > 0:  # the previous step is over
            self.step_s[self.step] = now - self.started
            self.peak_gib[self.step] = torch.cuda.max_memory_allocated() / 2**30 if self.clock.cuda else None
            self._close_pipeline_step()
            self._write()
        if self.clock.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.step += 1
        if self.profiling is not None:
            self._profile_edge()
        self.started = time.perf_counter()

    def timed(self, kind: str, stage: int, call: Callable[[], Any]) -> Any:
        if self.clock is None:
            return call()
        start = self.clock.mark()
        try:
            return call()
        finally:
            self._marks.append((kind, stage, start, self.clock.mark()))

    def span(self, call: Callable[[], Any]) -> Any:
        if self.clock is None:
            return call()
        start = self.clock.mark()
        try:
            return call()
        finally:
            self._span = (start, self.clock.mark())

    # -- profiling ----------------------------------------------------------------------------------

    def _profile_edge(self) -> None:
        """At the start of step `self.step`: start the profiler's warm-up (the step before the window), start
        recording (the window's first step), or stop and write the breakdown (the step after the window).
        Runs before the step's clock starts, so none of it is in a recorded step time."""
        window = self.profiling
        assert window is not None and self.clock is not None
        if self.step not in (window.start - 1, window.start, window.start + window.steps):
            return
        if self.clock.cuda:
            torch.cuda.synchronize()  # the window's edges: all work of the steps before is done
        if self.step == window.start - 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.clock.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            schedule = torch.profiler.schedule(wait=0, warmup=1, active=window.steps, repeat=1)
            self._prof = torch.profiler.profile(activities=activities, schedule=schedule)
            self._prof.start()
        elif self.step == window.start and self._prof is not None:
            self._prof.step()  # warm-up -> recording
            self._window_started = time.perf_counter()
        elif self._prof is not None:
            wall_s = time.perf_counter() - self._window_started
            prof, self._prof = self._prof, None
            prof.stop()
            self._write_profile(prof, wall_s, window)

    def _write_profile(self, prof: torch.profiler.profile, wall_s: float, window: ProfileWindow) -> None:
        from throughput import profile

        record: dict[str, Any] = {
            "rank": self.rank,
            "steps": [window.start, window.start + window.steps - 1],
            "wall_s": wall_s,
        }
        try:
            record["report"] = profile.breakdown(prof, wall_s, window.steps)
            if window.trace:
                trace = self.path.parent / f"rank{self.rank}_trace.json.gz"
                prof.export_chrome_trace(str(trace))
                record["trace"] = str(trace)
        except Exception as e:  # the row's numbers stand; the parent shows why it has no profile
            record["error"] = f"{type(e).__name__}: {e}"
        write_record(self.path.with_name(f"rank{self.rank}_profile.json"), record)

    # -- bookkeeping --------------------------------------------------------------------------------

    def _close_pipeline_step(self) -> None:
        if self._span is None or self.clock is None:
            return
        seconds = self.clock.seconds
        self.pipeline[self.step] = {
            "span_s": seconds(*self._span),
            "passes": [(kind, stage, seconds(a, b)) for kind, stage, a, b in self._marks],
        }
        self._span, self._marks = None, []

    def _write(self) -> None:
        record = {
            "rank": self.rank,
            "device": self.device,
            "step_s": self.step_s,
            "peak_gib": self.peak_gib,
            "pipeline": self.pipeline,
        }
        write_record(self.path, record)


def write_record(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def _wrap_pipeline(probe: RankProbe) -> None:
    """Time the stage passes and the rank's pipeline program (class attributes: every instance). The wrappers
    pass every argument through, so a change of those methods' signatures does not break a run."""
    from d9d.pipeline.runtime.executor import PipelineExecutor
    from d9d.pipeline.runtime.stage import StageRuntime

    forward, backward, backward_weight = (
        StageRuntime.forward,
        StageRuntime.backward,
        StageRuntime.backward_weight,
    )
    train_step = PipelineExecutor.train_step

    def timed_forward(self: StageRuntime, *args: Any, **kwargs: Any) -> Any:
        return probe.timed("F", self.index, lambda: forward(self, *args, **kwargs))

    def timed_backward(self: StageRuntime, *args: Any, **kwargs: Any) -> Any:
        kind = "I" if kwargs.get("split") else "B"
        return probe.timed(kind, self.index, lambda: backward(self, *args, **kwargs))

    def timed_backward_weight(self: StageRuntime, *args: Any, **kwargs: Any) -> Any:
        return probe.timed("W", self.index, lambda: backward_weight(self, *args, **kwargs))

    def timed_train_step(self: PipelineExecutor, *args: Any, **kwargs: Any) -> Any:
        return probe.span(lambda: train_step(self, *args, **kwargs))

    StageRuntime.forward = timed_forward  # type: ignore[method-assign]
    StageRuntime.backward = timed_backward  # type: ignore[method-assign]
    StageRuntime.backward_weight = timed_backward_weight  # type: ignore[method-assign]
    PipelineExecutor.train_step = timed_train_step  # type: ignore[method-assign]


@dataclass(frozen=True)
class ProfileWindow:
    """Profile steps `start` .. `start + steps - 1` (step `start - 1` is the profiler's warm-up; the breakdown
    is written when step `start + steps` begins, so the job must reach it)."""

    start: int
    steps: int
    trace: bool = False


def install(out_dir: Path, profiling: ProfileWindow | None = None) -> RankProbe:
    """The probe of this process (installed once; a second data provider in the process shares it)."""
    global _installed
    if _installed is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        out_dir.mkdir(parents=True, exist_ok=True)
        _installed = RankProbe(out_dir, rank, profiling)
        try:
            _wrap_pipeline(_installed)
        except (ImportError, AttributeError) as e:  # an engine without these: step times only
            print(f"throughput.probe: no pipeline timings ({type(e).__name__}: {e})", file=sys.stderr)
    return _installed


def read_records(out_dir: Path) -> list[dict[str, Any]]:
    """Every rank's record, by rank, with integer step keys."""
    records = []
    for path in out_dir.glob("rank*.json"):
        if not re.fullmatch(r"rank\d+\.json", path.name):
            continue  # rank<r>_profile.json
        record = json.loads(path.read_text())
        for key in ("step_s", "peak_gib", "pipeline"):
            record[key] = {int(step): value for step, value in record.get(key, {}).items()}
        records.append(record)
    return sorted(records, key=lambda r: int(r["rank"]))


def read_profiles(out_dir: Path) -> list[dict[str, Any]]:
    """Every rank's `rank<r>_profile.json`, by rank."""
    profiles = [json.loads(path.read_text()) for path in out_dir.glob("rank*_profile.json")]
    return sorted(profiles, key=lambda r: int(r["rank"]))
