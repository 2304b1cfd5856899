"""Metric points leave the coordinator through one writer thread, so a slow tracker backend (an MLflow
server, a SQLite store on a network disk) never delays the calls ranks make."""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from d9d.engine.runtime import MetricPoint

if TYPE_CHECKING:
    from d9d.cluster.spec import JobSpec

_log = logging.getLogger(__name__)


class MetricSink(Protocol):
    def write(self, points: Sequence[MetricPoint]) -> None: ...

    def close(self, status: str) -> None: ...


class MetricsWriter:
    """Builds the sink on its own thread (opening a tracker can take seconds) and writes every point as
    soon as it arrives, batching whatever queued up meanwhile."""

    def __init__(self, sink_factory: Callable[[], MetricSink]) -> None:
        self._queue: queue.Queue[MetricPoint | str] = queue.Queue()
        self._factory = sink_factory
        self._thread = threading.Thread(target=self._loop, name="d9d-metrics-writer", daemon=True)
        self._thread.start()

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
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            points = [item for item in items if isinstance(item, MetricPoint)]
            status = next((item for item in items if isinstance(item, str)), None)
            if points and sink is not None:
                try:
                    sink.write(points)
                except Exception:
                    _log.exception("writing %d metric points failed", len(points))
            if status is not None:
                if sink is not None:
                    sink.close(status)
                return


def metric_names(point: MetricPoint) -> dict[str, float]:
    """Tracker keys: train values as they are, `eval/…`, `health/rank-<r>/…`, and `cluster/…`."""
    if point.rank < 0:
        prefix = "cluster/"
    elif point.kind == "health":
        prefix = f"health/rank-{point.rank}/"
    elif point.kind == "eval":
        prefix = "eval/"
    else:
        prefix = ""
    return {f"{prefix}{key}": float(value) for key, value in point.values.items()}


class JsonlSink:
    """One JSON line per point in `<run dir>/metrics.jsonl`."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")

    def write(self, points: Sequence[MetricPoint]) -> None:
        for p in points:
            self._file.write(json.dumps({"step": p.step, "time": p.wall_time, **metric_names(p)}) + "\n")
        self._file.flush()

    def close(self, status: str) -> None:
        self._file.close()


def build_sink(spec: JobSpec) -> MetricSink:
    return JsonlSink(spec.run_dir / "metrics.jsonl")
