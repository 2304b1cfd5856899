"""Metric points → a tracker, on the writer side (the coordinator under Ray; rank 0 of a launcher without
one).

Tracker keys are grouped so that every UI (MLflow, TensorBoard, W&B sort sections by name) shows three
sections, whatever the world size, with the loss in the first one a reader looks for:
- `train/…`: the step's values from rank 0 (loss, lr, grad norm, tokens/s, MFU) and task metrics;
- `eval/…`: evaluation points;
- `system/rank<r>/…`: each rank's health (step time, memory); `system/cluster/…`: the coordinator's own
  points (rank -1: world size, restarts, metrics lag).

The tracker's resume state lives in `<run dir>/tracker_state.json`, so a restarted run continues the same
tracker run (the same MLflow run id) and the tracker skips steps it already holds. Beside the tracker, the
`train/` and `eval/` values go to `<run dir>/history.jsonl`, and closing the sink draws them into
`<run dir>/plots/training.png`.

With a storage root elsewhere (`run.storage`), the sink keeps those files following it there
(`run_files_mirror`): the tracker's own files (the MLflow SQLite store and artifacts, `metrics.jsonl`,
TensorBoard event files, the W&B folder), the history, the plot, the tracker state and the rank logs the
writer's node sees, each at its path relative to the run directory, so the storage root reads like a run
directory (`d9d plot/logs/status s3://bucket/runs/<run>`). The libraries keep writing their local files;
the mirror copies what changed at most every `mirror_interval_s` after a write, and everything at close.
A resumed run whose run directory lacks those files gets them back first (`TreeMirror.restore`, called by
the launchers before the tracker opens), so the tracker continues its run on another node.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from d9d.core.files import atomic_write_text
from d9d.core.storage import Location, TreeMirror
from d9d.engine.run_files import LOGS_DIR as LOGS_DIR
from d9d.engine.runtime import MetricPoint
from d9d.tracking import RunSpec, RunStatus, Tracker, TrackerConfig, tracker_files
from d9d.tracking.history import HISTORY_FILE, HistoryWriter, read_history
from d9d.tracking.plot import PLOT_FILE, plot_history

STATE_FILE = "tracker_state.json"
GROUPS = ("train/", "eval/", "system/")
#: How often, at most, a storage-root mirror copies the tracker's files while the run goes on.
MIRROR_INTERVAL_S = 30.0
_log = logging.getLogger(__name__)


def metric_names(point: MetricPoint) -> dict[str, float]:
    """The tracker keys of a point's values (see the module docstring); a key already grouped is kept."""
    if point.rank < 0:
        prefix = "system/cluster/"
    elif point.kind == "health":
        prefix = f"system/rank{point.rank}/"
    elif point.kind == "eval":
        prefix = "eval/"
    else:
        prefix = "train/"
    return {
        (key if key.startswith(GROUPS) else f"{prefix}{key}"): float(value)
        for key, value in point.values.items()
    }


class TrackerSink:
    """Feeds a `d9d.tracking` tracker: one `log_scalars` per step, merging the points of that step.

    `state_file` lies in the run directory. With `resume`, the tracker continues the run recorded there (when
    there is one). With
    `report_lag`, each write adds `system/cluster/metrics_lag_s`: how long its oldest point took from its
    rank to here (the same clock on one node).
    """

    def __init__(
        self,
        tracker: Tracker,
        run: RunSpec,
        state_file: Path,
        *,
        resume: bool,
        report_lag: bool = False,
        mirror: TreeMirror | None = None,
        mirror_interval_s: float = MIRROR_INTERVAL_S,
    ) -> None:
        self._tracker = tracker
        self._mirror = mirror
        self._mirror_interval_s = mirror_interval_s
        self._mirrored_at = time.monotonic()
        self._report_lag = report_lag
        self._run_name = run.name
        previous = json.loads(state_file.read_text()) if resume and state_file.is_file() else None
        tracker.open(run, resume=previous)
        state_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(state_file, json.dumps(tracker.resume_state()))
        self.run_dir = state_file.parent
        self._history = HistoryWriter(self.run_dir / HISTORY_FILE, resume=resume)

    def write(self, points: Sequence[MetricPoint]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for p in points:
            by_step.setdefault(p.step, {}).update(metric_names(p))
        reported = [p.wall_time for p in points if p.rank >= 0 and p.wall_time > 0]
        if self._report_lag and reported:
            by_step[max(by_step)]["system/cluster/metrics_lag_s"] = max(0.0, time.time() - min(reported))
        for step, values in sorted(by_step.items()):
            self._tracker.log_scalars(step, values)
            self._history.write(step, values)
        if time.monotonic() - self._mirrored_at >= self._mirror_interval_s:
            self.mirror()

    def __call__(self, point: MetricPoint) -> None:
        self.write([point])

    def close(self, status: RunStatus) -> None:
        self._history.close()
        try:
            self.plot()
        except Exception:  # a plot must never turn a finished run into a failed one
            _log.exception("drawing %s failed", self.run_dir / PLOT_FILE)
        try:
            self._tracker.close(status)
        finally:
            self.mirror()

    def mirror(self) -> None:
        """Copy the tracker's changed files to the storage root (no-op without one). A storage error is
        logged, not raised: the local files are whole, and the next interval or the close copies again."""
        self._mirrored_at = time.monotonic()
        if self._mirror is None:
            return
        try:
            self._mirror.sync()
        except Exception:
            _log.exception("copying the tracker's files to %s failed", self._mirror.target)

    def plot(self) -> Path | None:
        """Draw the history into `<run dir>/plots/training.png` (None when nothing was recorded)."""
        history_file = self.run_dir / HISTORY_FILE
        if not history_file.is_file():
            return None
        history = read_history(history_file)
        if not history:
            return None
        return plot_history(history, self.run_dir / PLOT_FILE, title=self._run_name)


def run_files_mirror(config: TrackerConfig, run_dir: Path, storage_root: Location) -> TreeMirror | None:
    """What a sink mirrors to `storage_root` (see the module docstring); None when the storage root is the
    run directory itself. A tracker file outside the run directory keeps only its name there."""
    run_dir = run_dir.resolve()
    if isinstance(storage_root, Path) and storage_root.resolve() == run_dir:
        return None
    local = [
        *tracker_files(config, run_dir),
        run_dir / STATE_FILE,
        run_dir / HISTORY_FILE,
        run_dir / PLOT_FILE,
        run_dir / LOGS_DIR,
    ]
    sources: dict[str, Path] = {}
    for path in local:
        path = path.resolve()
        name = path.relative_to(run_dir).as_posix() if path.is_relative_to(run_dir) else path.name
        name = "" if name == "." else name
        sources.setdefault(name, path)
    return TreeMirror(storage_root, sources)
