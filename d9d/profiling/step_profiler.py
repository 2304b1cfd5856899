"""torch.profiler over a window of training steps, one Chrome trace per rank and window.

The engine enters the profiler around its loop and calls `step()` after every training step; nothing else
in the loop knows about profiling. Steps before the window run unprofiled (`wait`), the next `warmup` steps
profile but discard (the first profiled step carries one-off setup costs), and the `active` steps are
written. Each rank writes its own file, with the rank in the name, so a multi-rank trace can be compared
side by side in Perfetto.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Protocol

import torch
from torch.profiler import ProfilerActivity, profile, schedule


class StepHook(Protocol):
    """What the training loop calls: a context manager with a per-step tick."""

    def __enter__(self) -> StepHook: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def step(self) -> None: ...


class NullProfiler:
    """Profiling disabled: the loop keeps calling `step()` unconditionally."""

    def __enter__(self) -> NullProfiler:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def step(self) -> None:
        return None


class StepProfiler:
    """Profiles steps `[first_step + wait + warmup, ... + active)` (and later windows when `repeat > 1`).

    `first_step` is the global step number of the first `step()` call (non-zero after a resume); it only
    names the files. Traces go to `traces_dir/rank{rank:05d}-steps{a}-{b}.json` (steps inclusive). A window
    cut short by the end of training is written with the steps it did record.
    """

    def __init__(
        self,
        traces_dir: Path | str,
        rank: int,
        *,
        wait: int,
        warmup: int,
        active: int,
        repeat: int = 1,
        first_step: int = 0,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        for name, value, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1)):
            if value < low:
                raise ValueError(f"profiler {name}={value} must be >= {low}")
        if repeat < 1:
            raise ValueError(f"profiler repeat={repeat} must be >= 1 (the window count)")
        if rank < 0:
            raise ValueError(f"profiler rank={rank} must be >= 0")
        self.traces_dir = Path(traces_dir)
        self.rank = rank
        self.first_step = first_step
        self.written: list[Path] = []
        self._cycle = wait + warmup + active
        self._recorded_from = wait + warmup  # offset of the first active step inside a cycle
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
            on_trace_ready=self._write,
            record_shapes=record_shapes,
            profile_memory=profile_memory,
            with_stack=with_stack,
        )

    def _write(self, prof: profile) -> None:
        # Called when a window's last step ends, or on exit inside a window (training stopped early):
        # either way `step_num` steps have completed, and the trace holds the completed active ones.
        last = prof.step_num - 1
        first = (last // self._cycle) * self._cycle + self._recorded_from
        if last < first:
            return  # stopped before the window's first active step completed: nothing worth keeping
        self.traces_dir.mkdir(parents=True, exist_ok=True)
        path = (
            self.traces_dir
            / f"rank{self.rank:05d}-steps{self.first_step + first}-{self.first_step + last}.json"
        )
        prof.export_chrome_trace(str(path))
        self.written.append(path)

    def __enter__(self) -> StepProfiler:
        self._profile.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._profile.__exit__(exc_type, exc, tb)

    def step(self) -> None:
        self._profile.step()
