"""`build_tracker`: the one place a tracker config becomes a tracker; `check_tracker` is its preflight and
`tracker_locations` says where a finished run's metrics are and how to look at them; `tracker_files` lists
the local files the trackers write."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

from d9d.tracking.config import (
    LogTrackerConfig,
    MlflowTrackerConfig,
    MultiTrackerConfig,
    NullTrackerConfig,
    TensorBoardTrackerConfig,
    TrackerConfig,
    WandbTrackerConfig,
)
from d9d.tracking.log_tracker import LogTracker
from d9d.tracking.null_tracker import NullTracker
from d9d.tracking.protocol import Tracker

# The package each backend imports, for the "install it" message.
_PACKAGES = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}


class TrackerError(ValueError):
    """A tracker that cannot work here: its package is missing or its store cannot be written."""


@dataclass(frozen=True)
class TrackerLocation:
    """Where one tracker keeps a run, and the command that shows it."""

    kind: str
    where: str
    command: str | None


def _resolve(run_dir: Path, path: str) -> Path:
    return (run_dir / path).resolve()


def mlflow_store(config: MlflowTrackerConfig, run_dir: str | Path) -> tuple[str, str | None]:
    """The tracking URI and artifact location the MLflow tracker uses."""
    uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri, None
    # The local default keeps store and artifacts inside the run directory.
    root = Path(run_dir).resolve()
    return f"sqlite:///{root / 'mlflow.db'}", (root / "mlartifacts").as_uri()


def build_tracker(config: TrackerConfig, run_dir: str | Path) -> Tracker:
    """Call on the writer side only (coordinator or rank 0); relative paths resolve against `run_dir`."""
    run_dir = Path(run_dir)
    match config:
        case MlflowTrackerConfig():
            from d9d.tracking.mlflow_tracker import MlflowTracker

            uri, artifacts = mlflow_store(config, run_dir)
            if artifacts is not None:
                run_dir.mkdir(parents=True, exist_ok=True)
            return MlflowTracker(uri, config.experiment, artifacts, config.disable_telemetry)
        case LogTrackerConfig():
            path = None if config.jsonl is None else run_dir / config.jsonl
            return LogTracker(path, sys.stdout if config.stdout else None, config.histogram_bins)
        case TensorBoardTrackerConfig():
            from d9d.tracking.tensorboard_tracker import TensorBoardTracker

            return TensorBoardTracker(_resolve(run_dir, config.log_dir), config.flush_secs)
        case WandbTrackerConfig():
            from d9d.tracking.wandb_tracker import WandbTracker, wandb_mode

            return WandbTracker(
                _resolve(run_dir, config.dir),
                config.project,
                config.entity,
                wandb_mode(config.mode),
                config.tags,
            )
        case NullTrackerConfig():
            return NullTracker()
        case MultiTrackerConfig():
            from d9d.tracking.multi_tracker import MultiTracker

            return MultiTracker([build_tracker(c, run_dir) for c in config.trackers])
        case _:
            assert_never(config)


def _stores(config: TrackerConfig, run_dir: Path) -> list[tuple[str, Path]]:
    """(kind, local path) of every store a tracker writes; remote stores (servers) are not listed."""
    match config:
        case MlflowTrackerConfig():
            uri, _ = mlflow_store(config, run_dir)
            if uri.startswith("sqlite:///"):
                return [("mlflow", Path(uri.removeprefix("sqlite:///")).resolve().parent)]
            if uri.startswith("file:") or "://" not in uri:
                return [("mlflow", Path(uri.removeprefix("file://").removeprefix("file:")).resolve())]
            return []
        case LogTrackerConfig():
            return [] if config.jsonl is None else [("log", _resolve(run_dir, config.jsonl).parent)]
        case TensorBoardTrackerConfig():
            return [("tensorboard", _resolve(run_dir, config.log_dir))]
        case WandbTrackerConfig():
            return [("wandb", _resolve(run_dir, config.dir))]
        case NullTrackerConfig():
            return []
        case MultiTrackerConfig():
            return [store for c in config.trackers for store in _stores(c, run_dir)]
        case _:
            assert_never(config)


def tracker_files(config: TrackerConfig, run_dir: str | Path) -> list[Path]:
    """The local files and directories the trackers write (what a storage root mirrors); a server's store
    (an MLflow server, W&B online) has none. Files a library has not created yet may be listed."""
    run_dir = Path(run_dir)
    match config:
        case MlflowTrackerConfig():
            uri, artifacts = mlflow_store(config, run_dir)
            files = [Path(a.removeprefix("file://")) for a in [artifacts] if a and a.startswith("file://")]
            if uri.startswith("sqlite:///"):
                return [Path(uri.removeprefix("sqlite:///")), *files]
            if uri.startswith("file:") or "://" not in uri:
                return [Path(uri.removeprefix("file://").removeprefix("file:")).resolve(), *files]
            return files
        case LogTrackerConfig():
            return [] if config.jsonl is None else [_resolve(run_dir, config.jsonl)]
        case TensorBoardTrackerConfig():
            return [_resolve(run_dir, config.log_dir)]
        case WandbTrackerConfig():
            return [_resolve(run_dir, config.dir) / "wandb"]
        case NullTrackerConfig():
            return []
        case MultiTrackerConfig():
            return [f for c in config.trackers for f in tracker_files(c, run_dir)]
        case _:
            assert_never(config)


def _kinds(config: TrackerConfig) -> list[str]:
    if isinstance(config, MultiTrackerConfig):
        return [k for c in config.trackers for k in _kinds(c)]
    return [config.kind]


def check_tracker(config: TrackerConfig, run_dir: str | Path, field: str = "logging.tracker") -> None:
    """Preflight, before any process starts: each backend's package is installed and each local store is
    a directory this process may write. Changes nothing on disk.

    A store whose nearest existing folder lies above the run directory's parent is not judged: the path may
    only exist on the cluster node that will write it (`d9d submit` validates on the submitting machine).
    """
    run_dir = Path(run_dir).resolve()
    for kind in _kinds(config):
        package = _PACKAGES.get(kind)
        if package is not None and importlib.util.find_spec(package) is None:
            raise TrackerError(
                f"{field}: tracker {kind!r} needs the {package!r} package, which is not installed "
                f"(pip install 'd9d[tracking]')"
            )
    for kind, store in _stores(config, run_dir):
        existing = store
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        near = (
            existing in (store, store.parent)
            or existing == run_dir.parent
            or run_dir.parent in existing.parents
        )
        if not near:
            continue  # only the machine that runs the job can tell
        if not existing.is_dir():
            raise TrackerError(
                f"{field}: tracker {kind!r} cannot open its store {store}: {existing} is a file, not a folder"
            )
        if not os.access(existing, os.W_OK | os.X_OK):
            raise TrackerError(
                f"{field}: tracker {kind!r} cannot write its store {store}: {existing} is read-only"
            )


def tracker_locations(config: TrackerConfig, run_dir: str | Path) -> list[TrackerLocation]:
    """Where each tracker keeps the run and the command that opens it (printed when a run ends)."""
    run_dir = Path(run_dir)
    match config:
        case MlflowTrackerConfig():
            uri, _ = mlflow_store(config, run_dir)
            command = None if uri.startswith("http") else f"mlflow ui --backend-store-uri {uri}"
            return [TrackerLocation("mlflow", uri, command)]
        case LogTrackerConfig():
            if config.jsonl is None:
                return []
            return [TrackerLocation("log", str(_resolve(run_dir, config.jsonl)), None)]
        case TensorBoardTrackerConfig():
            log_dir = _resolve(run_dir, config.log_dir)
            return [TrackerLocation("tensorboard", str(log_dir), f"tensorboard --logdir {log_dir}")]
        case WandbTrackerConfig():
            from d9d.tracking.wandb_tracker import wandb_mode

            folder = _resolve(run_dir, config.dir) / "wandb"
            if wandb_mode(config.mode) == "offline":
                return [TrackerLocation("wandb", str(folder), f"wandb sync {folder}/offline-run-*")]
            return [TrackerLocation("wandb", f"project {config.project}", None)]
        case NullTrackerConfig():
            return []
        case MultiTrackerConfig():
            return [loc for c in config.trackers for loc in tracker_locations(c, run_dir)]
        case _:
            assert_never(config)
