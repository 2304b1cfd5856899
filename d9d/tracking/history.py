"""The run's metric history in the run directory, whatever the tracker: what `d9d plot` draws.

`<run dir>/history.jsonl` holds one `{"step": N, "t": wall-clock seconds, "values": {...}}` line per write
of `train/…` and `eval/…` values (the per-rank `system/…` values stay in the tracker). A resumed run
appends; a reader keeps the last value written for each (name, step), so steps a restarted job recomputed
count once. `summarize_history` is what `d9d status` and `d9d list` read of it: the newest step, its loss
and tokens/s, and the recent step rate (for an ETA).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from d9d.core.storage import Location

HISTORY_FILE = "history.jsonl"
#: Which grouped names the history keeps: the curves, and the run's resumes and restarts (where `d9d plot`
#: marks them: the step an attempt that started from a commit trained first, the commit's step, and whether
#: it was a restart after a failure or a resize (1) or a launch resuming the run (0)).
KEPT_GROUPS = ("train/", "eval/")
RESUMED_FROM = "system/cluster/resumed_from"
RESTART = "system/cluster/restart"
KEPT_NAMES = (RESUMED_FROM, RESTART)


class HistoryWriter:
    def __init__(self, path: Path, *, resume: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] | None = path.open("a" if resume else "w")

    def write(self, step: int, values: Mapping[str, float]) -> None:
        kept = {k: float(v) for k, v in values.items() if k.startswith(KEPT_GROUPS) or k in KEPT_NAMES}
        if kept and self._file is not None:
            line = {"step": step, "t": round(time.time(), 3), "values": kept}
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_history(path: Location) -> dict[str, dict[int, float]]:
    """name -> {step: value}, the last write of each step winning; a torn last line is skipped. `path` may
    be in a storage root (`run.storage`), where the run's writer copies it."""
    series: dict[str, dict[int, float]] = {}
    for line in path.read_bytes().decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves at most one partial line
        for name, value in record["values"].items():
            series.setdefault(name, {})[int(record["step"])] = float(value)
    return series


@dataclass(frozen=True)
class HistorySummary:
    """The newest step of a history and how fast the steps went lately."""

    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    written_at: float | None = None  # wall clock of the newest line
    seconds_per_step: float | None = None  # over the newest lines of the current stretch (none: unknown)


_RATE_WINDOW = 20  # lines the step rate is measured over


def summarize_history(path: Location) -> HistorySummary:
    """What a run's history says of its progress; an empty summary when the file does not exist."""
    try:
        text = path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return HistorySummary()
    timed: list[tuple[int, float]] = []
    step: int | None = None
    values: dict[str, float] = {}
    written_at: float | None = None
    for line in text.splitlines():
        try:
            record = json.loads(line)
            at, where = record.get("t"), int(record["step"])
            new = {k: float(v) for k, v in record["values"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if "train/loss" not in new:
            continue
        if step is not None and where <= step:
            timed.clear()  # a resumed run went back to its checkpoint: a new stretch starts
        step, values = where, new
        if isinstance(at, int | float):
            written_at = float(at)
            timed.append((where, written_at))
    timed = timed[-_RATE_WINDOW:]
    rate = None
    if len(timed) >= 2 and timed[-1][0] > timed[0][0] and timed[-1][1] >= timed[0][1]:
        rate = (timed[-1][1] - timed[0][1]) / (timed[-1][0] - timed[0][0])
    return HistorySummary(step, values.get("train/loss"), values.get("train/tokens_per_s"), written_at, rate)


def last_values(path: Location) -> tuple[int | None, float | None]:
    """(newest step, its loss) of a history; (None, None) without one."""
    summary = summarize_history(path)
    return summary.step, summary.loss
