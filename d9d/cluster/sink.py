"""Metric points leave the coordinator through one writer thread, so a slow tracker backend (an MLflow
server, a SQLite store on a network disk) never delays the calls ranks make."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from d9d.cluster.rank import is_setup_point
from d9d.engine.runtime import MetricPoint
from d9d.engine.tracking_sink import STATE_FILE, TrackerSink, run_files_mirror
from d9d.tracking import RunSpec, RunStatus, build_tracker

if TYPE_CHECKING:
    from d9d.cluster.spec import JobSpec

_log = logging.getLogger(__name__)


class MetricSink(Protocol):
    def write(self, points: Sequence[MetricPoint]) -> None: ...

    def close(self, status: RunStatus) -> None: ...


@dataclass(frozen=True)
class _Close:
    status: RunStatus


class MetricsWriter:
    """Builds the sink on its own thread (opening a tracker can take seconds) and writes what arrived at
    most every `min_interval_s`: one tracker transaction per interval instead of one per step keeps a
    fast-stepping job from spending a CPU core on its tracker, at a bounded cost in lag."""

    def __init__(self, sink_factory: Callable[[], MetricSink], min_interval_s: float = 0.2) -> None:
        self._queue: queue.Queue[MetricPoint | _Close] = queue.Queue()
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

    def close(self, status: RunStatus, timeout_s: float = 60.0) -> None:
        self._queue.put(_Close(status))
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
            status = next((item.status for item in items if isinstance(item, _Close)), None)
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

    A rank's setup point (`d9d.cluster.rank.is_setup_point`) always passes: each attempt's rank reports
    one, timing that attempt's own start-up, so it is never a replay, though a restarted attempt's comes at
    a step the failed attempt's came at too (step 0; rank 0's at the commit it resumes from).
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, int, tuple[str, ...]], int] = {}

    def fresh(self, point: MetricPoint) -> bool:
        if is_setup_point(point):
            return True
        key = (point.kind, point.rank, tuple(sorted(point.values)))
        if point.step <= self._last.get(key, -1):
            return False
        self._last[key] = point.step
        return True


def build_sink(spec: JobSpec) -> MetricSink:
    """The tracker the engine config names (`logging.tracker`); MLflow with a SQLite store in the run
    directory when it names none. With `run.storage`, the tracker's files follow it to the storage root."""
    from d9d.cluster.spec import tracker_config
    from d9d.engine.checkpoint import committed_steps

    config = tracker_config(spec)
    from d9d.engine.launch import run_params

    params = {**run_params(spec.train), "cluster": spec.cluster.model_dump(mode="json")}
    run = RunSpec(name=spec.run_name, params=params, tags={"d9d.launcher": "ray"})
    resume = bool(committed_steps(spec.checkpoint_dir))  # no hashing here: the store verifies
    mirror = run_files_mirror(config, spec.run_dir, spec.storage_root)
    if mirror is not None and resume:
        mirror.restore()  # a coordinator on a new node continues the tracker's run from the storage root
    tracker = build_tracker(config, spec.run_dir)
    return TrackerSink(tracker, run, spec.run_dir / STATE_FILE, resume=resume, report_lag=True, mirror=mirror)
