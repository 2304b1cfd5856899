"""`build_tracker`: the one place a tracker config becomes a tracker."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from d9d.tracking.config import LogTrackerConfig, MlflowTrackerConfig, NullTrackerConfig, TrackerConfig
from d9d.tracking.log_tracker import LogTracker
from d9d.tracking.null_tracker import NullTracker
from d9d.tracking.protocol import Tracker


def build_tracker(config: TrackerConfig, run_dir: str | Path) -> Tracker:
    """Call on the writer side only (coordinator or rank 0); relative paths resolve against `run_dir`."""
    run_dir = Path(run_dir)
    if isinstance(config, MlflowTrackerConfig):
        from d9d.tracking.mlflow_tracker import MlflowTracker

        uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:  # the local default keeps store and artifacts inside the run directory
            run_dir.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
            artifacts = (run_dir.resolve() / "mlartifacts").as_uri()
        return MlflowTracker(uri, config.experiment, artifacts, config.disable_telemetry)
    if isinstance(config, LogTrackerConfig):
        path = None if config.jsonl is None else run_dir / config.jsonl
        return LogTracker(path, sys.stdout if config.stdout else None, config.histogram_bins)
    if isinstance(config, NullTrackerConfig):
        return NullTracker()
    raise TypeError(f"build_tracker: unknown tracker config {type(config).__name__}")
