"""Metric points → a tracker, on the writer side (the coordinator under Ray; rank 0 of a launcher without
one). Tracker keys: train/eval values as they are, `health/rank<r>/…` per rank, `cluster/…` for the
coordinator's own points (rank -1).

The tracker's resume state lives in `<run dir>/tracker_state.json`, so a restarted run continues the same
tracker run (the same MLflow run id) and the tracker skips steps it already holds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from d9d.core.files import atomic_write_text
from d9d.engine.runtime import MetricPoint
from d9d.tracking import RunSpec, RunStatus, Tracker

STATE_FILE = "tracker_state.json"


def metric_names(point: MetricPoint) -> dict[str, float]:
    if point.rank < 0:
        prefix = "cluster/"
    elif point.kind == "health":
        prefix = f"health/rank{point.rank}/"
    else:
        prefix = ""
    return {f"{prefix}{key}": float(value) for key, value in point.values.items()}


class TrackerSink:
    """Feeds a `d9d.tracking` tracker: one `log_scalars` per step, merging the points of that step.

    With `resume`, the tracker continues the run recorded in `state_file` (when there is one). With
    `report_lag`, each write adds `cluster/metrics_lag_s`: how long its oldest point took from its rank to
    here (the same clock on one node).
    """

    def __init__(
        self, tracker: Tracker, run: RunSpec, state_file: Path, *, resume: bool, report_lag: bool = False
    ) -> None:
        self._tracker = tracker
        self._report_lag = report_lag
        previous = json.loads(state_file.read_text()) if resume and state_file.is_file() else None
        tracker.open(run, resume=previous)
        state_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(state_file, json.dumps(tracker.resume_state()))

    def write(self, points: Sequence[MetricPoint]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for p in points:
            by_step.setdefault(p.step, {}).update(metric_names(p))
        reported = [p.wall_time for p in points if p.rank >= 0 and p.wall_time > 0]
        if self._report_lag and reported:
            by_step[max(by_step)]["cluster/metrics_lag_s"] = max(0.0, time.time() - min(reported))
        for step, values in sorted(by_step.items()):
            self._tracker.log_scalars(step, values)

    def __call__(self, point: MetricPoint) -> None:
        self.write([point])

    def close(self, status: RunStatus) -> None:
        self._tracker.close(status)
