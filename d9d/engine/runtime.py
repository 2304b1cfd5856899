"""The contract between a per-rank engine run and whoever launched it.

The same engine code runs in a bare process, under torchrun, and inside a Ray rank actor. What differs is
where metrics go, who decides that a checkpoint is committed, and where control commands (pause, stop,
checkpoint now) come from. That is the `RunReporter`; everything crossing it is plain data, so the Ray layer
can ship it between processes and the engine never imports Ray.

Rules the engine follows (and launchers may rely on):
- `reporter.commands()` is called only on global rank 0, once per step boundary; rank 0 broadcasts the
  result so every rank applies the same command at the same step.
- When a PAUSE stops the ranks at a boundary, rank 0 reports a `health` point `{"paused": 1.0}` at that
  step: launchers tell "paused" from "pause requested" by it. A SLEEP pauses the same way; once the
  training state is in host memory rank 0 reports `{"asleep": 1.0, ...}`, and `{"asleep": 0.0, ...}` once
  a WAKE (or a RESUME or STOP, which wake first) brought it back.
- A checkpoint step is written by every rank into `<checkpoint_root>/step-<N>/`; each rank then calls
  `checkpoint_written` with its files (a launcher without shared storage uploads them there). After every
  rank returned from it, rank 0 gathers all reports and calls `commit_checkpoint`, which writes the manifest
  and moves the `latest` pointer atomically. Until then the previous committed step stays "latest".
- Metric points are fire-and-forget: reporting must never block the step on a slow consumer.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from d9d.core.storage import Location


@dataclass(frozen=True)
class RankRuntime:
    """Facts about this rank's process that the config cannot know."""

    rank: int
    world_size: int
    local_rank: int
    run_dir: Path
    attempt: int = 0  # 0 for the first start, +1 for every restart after a failure
    # Elastic restarts change the data-parallel degree; the engine keeps the global batch constant.
    data_parallel_override: int | None = None


@dataclass(frozen=True)
class MetricPoint:
    step: int
    rank: int
    values: dict[str, float]
    kind: Literal["train", "health", "eval"] = "train"
    wall_time: float = 0.0


def reports_train_metrics(step: int, period: int, total_steps: int) -> bool:
    """Whether rank 0 reports `step`'s training metrics, its loss among them (a `train` point): every
    `logging.period`-th step and the last. Launchers rely on it (the coordinator waits for a step's loss)."""
    return step % period == 0 or step == total_steps


class CommandKind(enum.StrEnum):
    PAUSE = "pause"
    RESUME = "resume"
    CHECKPOINT_NOW = "checkpoint_now"
    UPDATE = "update"
    STOP = "stop"
    SLEEP = "sleep"  # pause, then move the training state to host memory (d9d.engine.offload)
    WAKE = "wake"  # bring the state back; the ranks stay paused until a RESUME


@dataclass(frozen=True)
class Command:
    """A control command; takes effect at the next step boundary on every rank."""

    kind: CommandKind
    # For UPDATE: the live-safe settings to change, e.g. {"lr": 1e-4}.
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointFile:
    relative_path: str  # relative to the step directory
    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class RankCheckpointReport:
    step: int
    rank: int
    step_dir: Location
    files: tuple[CheckpointFile, ...]


@dataclass(frozen=True)
class RankResult:
    """What a finished engine run returns on each rank."""

    status: Literal["finished", "stopped"]
    steps: int  # last completed step
    final_loss: float | None
    tokens_per_s: float | None  # the last step's processed (non-padding) positions per second
    losses: tuple[float, ...] = ()  # per-step global loss of the steps this attempt ran (main rank)


class RunReporter(Protocol):
    def metrics(self, point: MetricPoint) -> None:
        """Deliver a metric point; never blocks on the consumer."""
        ...

    def commands(self, step: int) -> Sequence[Command]:
        """Pending commands (rank 0 only); returns immediately, empty when there are none."""
        ...

    def checkpoint_written(self, report: RankCheckpointReport) -> None:
        """This rank finished writing its part of a checkpoint step (every rank calls it)."""
        ...

    def commit_checkpoint(self, step: int, reports: Sequence[RankCheckpointReport]) -> None:
        """Every rank's part of `step` is written: make it the step to resume from (rank 0 only). A reporter
        may return before the step is committed (coordinator storage queues the commit behind its uploads);
        the step then becomes latest once every rank's files arrived and verified, or never."""
        ...

    def latest_checkpoint(self) -> Location | None:
        """The committed step directory to resume from, if any (every rank calls it at start-up): the newest
        commit whose files verify against its manifest (`d9d.engine.checkpoint.select_commit`)."""
        ...


_STEP_ATTR = "d9d_step"


def mark_failed_step(error: BaseException, step: int) -> None:
    """Note on `error` the training step it was raised in, for a launcher to report (`failed_step`) and in
    its traceback. The first mark wins."""
    if failed_step(error) is not None:
        return
    with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__
        setattr(error, _STEP_ATTR, step)
        error.add_note(f"(d9d: raised in training step {step})")


def failed_step(error: BaseException) -> int | None:
    """The training step `error` was raised in, when the engine marked it (`mark_failed_step`)."""
    step = getattr(error, _STEP_ATTR, None)
    return step if isinstance(step, int) else None
