"""`MultiTracker`: the same run in several trackers at once (e.g. MLflow and TensorBoard)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from d9d.tracking.protocol import HistogramValues, RunSpec, RunStatus, Tracker, check_resume_kind


class MultiTracker:
    """Forwards every call to each tracker in order; the resume state holds each one's own."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        if not trackers:
            raise ValueError("MultiTracker: give at least one tracker")
        self.trackers = tuple(trackers)

    def open(self, run: RunSpec, resume: Mapping[str, Any] | None = None) -> None:
        states: list[Mapping[str, Any] | None] = [None] * len(self.trackers)
        if resume is not None:
            check_resume_kind(resume, "multi")
            stored = list(resume["trackers"])
            if len(stored) != len(self.trackers):
                raise ValueError(
                    f"cannot resume a run of {len(stored)} trackers with {len(self.trackers)} trackers"
                )
            states = stored
        for tracker, state in zip(self.trackers, states, strict=True):
            tracker.open(run, resume=state)

    def resume_state(self) -> dict[str, Any]:
        return {"kind": "multi", "trackers": [t.resume_state() for t in self.trackers]}

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        for tracker in self.trackers:
            tracker.log_scalars(step, values)

    def log_histogram(self, step: int, name: str, values: HistogramValues) -> None:
        for tracker in self.trackers:
            tracker.log_histogram(step, name, values)

    def close(self, status: RunStatus = "finished") -> None:
        errors: list[BaseException] = []
        for tracker in self.trackers:  # every tracker gets closed even when one fails
            try:
                tracker.close(status)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]
