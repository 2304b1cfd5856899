"""Metric points leave the coordinator through one writer thread, so a slow tracker backend (an MLflow
server, a SQLite store on a network disk) never delays the calls ranks make."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from d9d.engine.runtime import MetricPoint
from d9d.tracking import RunSpec, Tracker, build_tracker
from d9d.tracking.protocol import RunStatus

if TYPE_CHECKING:
    from d9d.cluster.spec import JobSpec

_log = logging.getLogger(__name__)


class MetricSink(Protocol):
    def write(self, points: Sequence[MetricPoint]) -> None: ...

    def close(self, status: str) -> None: ...


class MetricsWriter:
    """Builds the sink on its own thread (opening a tracker can take seconds) and writes what arrived at
    most every `min_interval_s`: one tracker transaction per interval instead of one per step keeps a
    fast-stepping job from spending a CPU core on its tracker, at a bounded cost in lag."""

    def __init__(self, sink_factory: Callable[[], MetricSink], min_interval_s: float = 0.2) -> None:
        self._queue: queue.Queue[MetricPoint | str] = queue.Queue()
        self._factory = sink_factory
        self._interval = min_interval_s
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="d9d-metrics-writer", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the sink is open (or failed to open), so points are written as they come."""
        return self._ready.wait(timeout_s)

    def submit(self, point: MetricPoint) -> None:
        self._queue.put(point)

    def close(self, status: str, timeout_s: float = 60.0) -> None:
        self._queue.put(status)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        sink: MetricSink | None = None
        try:
            sink = self._factory()
        except Exception:
            _log.exception("cannot open the metrics tracker; metrics are not recorded")
        self._ready.set()
        last = 0.0
        while True:
            items = [self._queue.get()]
            wait = last + self._interval - time.monotonic()
            if wait > 0 and isinstance(items[0], MetricPoint):
                time.sleep(wait)
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            points = [item for item in items if isinstance(item, MetricPoint)]
            status = next((item for item in items if isinstance(item, str)), None)
            if points and sink is not None:
                try:
                    sink.write(points)
                except Exception:
                    _log.exception("writing %d metric points failed", len(points))
                last = time.monotonic()
            if status is not None:
                if sink is not None:
                    sink.close(status)
                return


class ReplayFilter:
    """Keeps a restarted attempt's recomputed steps out of the tracker.

    After a restart the ranks train again the steps between the checkpoint and the failure and report
    them a second time; a stream only moves forward. A stream is one source of one kind of values: (kind,
    rank, the value names), because one rank reports several streams per step (the step's loss, task
    metrics that a background collector finishes steps later) and each must pass on its own.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, int, tuple[str, ...]], int] = {}

    def fresh(self, point: MetricPoint) -> bool:
        key = (point.kind, point.rank, tuple(sorted(point.values)))
        if point.step <= self._last.get(key, -1):
            return False
        self._last[key] = point.step
        return True


def metric_names(point: MetricPoint) -> dict[str, float]:
    """Tracker keys, as the engine's own launchers name them: train/eval values as they are,
    `health/rank<r>/…` per rank, and `cluster/…` for the coordinator's own (rank -1)."""
    if point.rank < 0:
        prefix = "cluster/"
    elif point.kind == "health":
        prefix = f"health/rank{point.rank}/"
    else:
        prefix = ""
    return {f"{prefix}{key}": float(value) for key, value in point.values.items()}


class TrackerSink:
    """Feeds a `d9d.tracking` tracker: one `log_scalars` per step, merging the points of that step.

    The tracker's resume state is kept in the run directory. When the job resumes from a checkpoint
    (a later `d9d train` of the same run), the same tracker run continues and the steps recomputed
    after the checkpoint are not written twice.
    """

    def __init__(self, tracker: Tracker, run: RunSpec, state_file: Path, resume: bool) -> None:
        self._tracker = tracker
        previous = json.loads(state_file.read_text()) if resume and state_file.is_file() else None
        tracker.open(run, resume=previous)
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(tracker.resume_state()))

    def write(self, points: Sequence[MetricPoint]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for p in points:
            by_step.setdefault(p.step, {}).update(metric_names(p))
        reported = [p.wall_time for p in points if p.rank >= 0 and p.wall_time > 0]
        if reported:  # how long the oldest point took from its rank to here (same clock on one node)
            by_step[max(by_step)]["cluster/metrics_lag_s"] = max(0.0, time.time() - min(reported))
        for step, values in sorted(by_step.items()):
            self._tracker.log_scalars(step, values)

    def close(self, status: str) -> None:
        self._tracker.close(_TRACKER_STATUS.get(status, "failed"))


_TRACKER_STATUS: dict[str, RunStatus] = {"finished": "finished", "stopped": "killed", "failed": "failed"}


def build_sink(spec: JobSpec) -> MetricSink:
    """The tracker the engine config names (`logging.tracker`); MLflow with a SQLite store in the run
    directory when it names none."""
    from d9d.cluster.checkpoints import CheckpointStore
    from d9d.cluster.spec import tracker_config

    config = tracker_config(spec)
    from d9d.engine.launch import run_params

    params = {**run_params(spec.train), "cluster": spec.cluster.model_dump(mode="json")}
    run = RunSpec(name=spec.run_name, params=params, tags={"d9d.launcher": "ray"})
    resume = CheckpointStore(spec.checkpoint_dir, spec.train.checkpointing.keep_last).latest() is not None
    return TrackerSink(build_tracker(config, spec.run_dir), run, spec.run_dir / "tracker_state.json", resume)
