"""Metric points → a tracker, on the writer side (rank 0 of a launcher without a coordinator).

The tracker's resume state lives in `<run dir>/tracker_state.json`, so a restarted run continues the same
tracker run (the same MLflow run id) and the tracker skips steps it already holds.
"""

from __future__ import annotations

import json
from pathlib import Path

from d9d.engine.runtime import MetricPoint
from d9d.tracking import RunSpec, RunStatus, Tracker, TrackerConfig, build_tracker

STATE_FILE = "tracker_state.json"


class TrackerSink:
    def __init__(self, config: TrackerConfig, run_dir: Path, run: RunSpec) -> None:
        self.run_dir = run_dir
        self.tracker: Tracker = build_tracker(config, run_dir)
        state_file = run_dir / STATE_FILE
        resume = json.loads(state_file.read_text()) if state_file.is_file() else None
        self.tracker.open(run, resume=resume)
        run_dir.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(self.tracker.resume_state()))

    def __call__(self, point: MetricPoint) -> None:
        if point.kind == "health":
            values = {f"health/rank{point.rank}/{k}": v for k, v in point.values.items()}
        else:
            values = dict(point.values)
        self.tracker.log_scalars(point.step, values)

    def close(self, status: RunStatus = "finished") -> None:
        self.tracker.close(status)
