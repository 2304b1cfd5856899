"""Experiment tracking for the writer side of a job: MLflow, stdout/JSON lines, or nothing."""

from d9d.tracking.build import build_tracker
from d9d.tracking.config import LogTrackerConfig, MlflowTrackerConfig, NullTrackerConfig, TrackerConfig
from d9d.tracking.log_tracker import LogTracker
from d9d.tracking.null_tracker import NullTracker
from d9d.tracking.protocol import (
    HistogramValues,
    RunSpec,
    RunStatus,
    Tracker,
    flatten_params,
    histogram_summary,
)

__all__ = [
    "HistogramValues",
    "LogTracker",
    "LogTrackerConfig",
    "MlflowTrackerConfig",
    "NullTracker",
    "NullTrackerConfig",
    "RunSpec",
    "RunStatus",
    "Tracker",
    "TrackerConfig",
    "build_tracker",
    "flatten_params",
    "histogram_summary",
]
