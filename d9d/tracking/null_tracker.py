"""`NullTracker`: accepts everything, writes nothing (non-writer processes, tests, dry runs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from d9d.tracking.protocol import HistogramValues, RunSpec, RunStatus


class NullTracker:
    def open(self, run: RunSpec, resume: Mapping[str, Any] | None = None) -> None:
        pass

    def resume_state(self) -> dict[str, Any]:
        return {"kind": "null"}

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        pass

    def log_histogram(self, step: int, name: str, values: HistogramValues) -> None:
        pass

    def close(self, status: RunStatus = "finished") -> None:
        pass
