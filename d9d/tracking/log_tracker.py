"""`LogTracker`: human-readable lines on a text stream and machine-readable JSON lines in a file.

The file holds one record per event (`open`, `scalars`, `histogram`, `close`). A fresh run starts the
file anew; a resumed run appends to it and skips steps the file already has.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from d9d.tracking.protocol import (
    HistogramValues,
    RunSpec,
    RunStatus,
    StepFloor,
    check_resume_kind,
    flatten_params,
    histogram_summary,
)


def _last_step(path: Path) -> int | None:
    last: int | None = None
    with path.open() as f:
        for line in f:
            step = json.loads(line).get("step")
            if step is not None and (last is None or step > last):
                last = step
    return last


class LogTracker:
    """Writes to `stream` (None: silent) and to the JSON-lines file `path` (None: no file)."""

    def __init__(
        self, path: Path | None, stream: IO[str] | None = sys.stdout, histogram_bins: int = 64
    ) -> None:
        if histogram_bins < 1:
            raise ValueError(f"LogTracker: histogram_bins must be >= 1, got {histogram_bins}")
        self._path = path
        self._stream = stream
        self._bins = histogram_bins
        self._file: IO[str] | None = None
        self._floor = StepFloor()
        self._run: RunSpec | None = None

    def open(self, run: RunSpec, resume: Mapping[str, Any] | None = None) -> None:
        if self._run is not None:
            raise RuntimeError(f"LogTracker: run {self._run.name!r} is already open")
        if resume is not None:
            check_resume_kind(resume, "log")
            if self._path is not None and self._path.exists():
                self._floor = StepFloor(_last_step(self._path))
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self._path.open("a" if resume is not None else "w")
        self._run = run
        params = flatten_params(run.params)
        self._write(
            {
                "event": "open",
                "run": run.name,
                "resumed": resume is not None,
                "params": params,
                "tags": dict(run.tags),
            }
        )
        verb = "resumed" if resume is not None else "opened"
        after = (
            f" (skipping steps <= {self._floor.last_logged})" if self._floor.last_logged is not None else ""
        )
        self._print(f"run {run.name!r} {verb}{after}")

    def resume_state(self) -> dict[str, Any]:
        return {"kind": "log", "path": None if self._path is None else str(self._path)}

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._require_open()
        if not self._floor.allows(step):
            return
        scalars = {k: float(v) for k, v in values.items()}
        self._write({"event": "scalars", "step": step, "values": scalars})
        self._print(f"step {step} | " + " | ".join(f"{k} {v:.6g}" for k, v in scalars.items()))

    def log_histogram(self, step: int, name: str, values: HistogramValues) -> None:
        self._require_open()
        if not self._floor.allows(step):
            return
        data = np.asarray(values, dtype=np.float64).reshape(-1)
        stats = histogram_summary(data)
        record: dict[str, Any] = {"event": "histogram", "step": step, "name": name, "stats": stats}
        if data.size:
            counts, edges = np.histogram(data, bins=self._bins)
            record["counts"], record["edges"] = counts.tolist(), edges.tolist()
        self._write(record)
        self._print(f"step {step} | {name} " + " ".join(f"{k}={v:.4g}" for k, v in stats.items()))

    def close(self, status: RunStatus = "finished") -> None:
        if self._run is None:
            return
        self._write({"event": "close", "status": status})
        self._print(f"run {self._run.name!r} {status}")
        if self._file is not None:
            self._file.close()
            self._file = None
        self._run = None

    def _require_open(self) -> None:
        if self._run is None:
            raise RuntimeError("LogTracker: call open() before logging")

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"time": time.time(), **record}, default=str) + "\n")
            self._file.flush()

    def _print(self, line: str) -> None:
        if self._stream is not None:
            print(f"[d9d] {line}", file=self._stream, flush=True)
