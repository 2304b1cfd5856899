"""The run's metric history in the run directory, whatever the tracker: what `d9d plot` draws.

`<run dir>/history.jsonl` holds one `{"step": N, "values": {...}}` line per write of `train/…` and `eval/…`
values (the per-rank `system/…` values stay in the tracker). A resumed run appends; a reader keeps the last
value written for each (name, step), so steps a restarted job recomputed count once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from d9d.core.storage import Location

HISTORY_FILE = "history.jsonl"
#: Which grouped names the history keeps.
KEPT_GROUPS = ("train/", "eval/")


class HistoryWriter:
    def __init__(self, path: Path, *, resume: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] | None = path.open("a" if resume else "w")

    def write(self, step: int, values: Mapping[str, float]) -> None:
        kept = {k: float(v) for k, v in values.items() if k.startswith(KEPT_GROUPS)}
        if kept and self._file is not None:
            self._file.write(json.dumps({"step": step, "values": kept}) + "\n")
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
