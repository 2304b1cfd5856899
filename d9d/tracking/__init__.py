"""Experiment tracking for the writer side of a job: MLflow, TensorBoard, Weights & Biases, JSON lines,
several at once, or nothing; plus the run's metric history and its plot."""

from d9d.tracking.build import (
    TrackerError,
    TrackerLocation,
    build_tracker,
    check_tracker,
    tracker_files,
    tracker_locations,
)
from d9d.tracking.config import (
    LogTrackerConfig,
    MlflowTrackerConfig,
    MultiTrackerConfig,
    NullTrackerConfig,
    SingleTrackerConfig,
    TensorBoardTrackerConfig,
    TrackerConfig,
    WandbTrackerConfig,
)
from d9d.tracking.log_tracker import LogTracker
from d9d.tracking.multi_tracker import MultiTracker
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
    "MultiTracker",
    "MultiTrackerConfig",
    "NullTracker",
    "NullTrackerConfig",
    "RunSpec",
    "RunStatus",
    "SingleTrackerConfig",
    "TensorBoardTrackerConfig",
    "Tracker",
    "TrackerConfig",
    "TrackerError",
    "TrackerLocation",
    "WandbTrackerConfig",
    "build_tracker",
    "check_tracker",
    "flatten_params",
    "histogram_summary",
    "tracker_files",
    "tracker_locations",
]
