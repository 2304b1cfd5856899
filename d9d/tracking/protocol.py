"""The `Tracker` trait: what the writer side of a training job needs from an experiment-tracking backend.

Exactly one process per job writes (the coordinator, or rank 0 without one); it holds the tracker, and
the ranks send it their already-synced metric values. A tracker therefore never touches torch or
torch.distributed and works in any process.

Resume contract: after `open`, `resume_state()` is a small JSON-serializable dict that the job stores
with its checkpoint. A restarted job passes it back to `open(run, resume=state)`, which continues the
same run and drops every write for a step at or below the last step the backend already holds: the
restarted job recomputes the steps after its checkpoint, and those must not appear twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

RunStatus = Literal["finished", "failed", "killed"]
#: Anything `numpy.asarray` turns into numbers: sequences, NumPy arrays, CPU torch tensors.
HistogramValues = npt.ArrayLike


@dataclass(frozen=True)
class RunSpec:
    """What a run is called and configured with. Nested `params` are flattened to dotted keys."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)


@runtime_checkable
class Tracker(Protocol):
    def open(self, run: RunSpec, resume: Mapping[str, Any] | None = None) -> None:
        """Start a run, or continue the one `resume` (an earlier `resume_state()`) names."""

    def resume_state(self) -> dict[str, Any]:
        """JSON-serializable state that lets a restarted job continue this run."""

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def log_histogram(self, step: int, name: str, values: HistogramValues) -> None: ...

    def close(self, status: RunStatus = "finished") -> None: ...


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"optim": {"lr": 1e-3}}` -> `{"optim.lr": 1e-3}`; leaves other than mappings are kept as is."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_params(value, name))
        else:
            out[name] = value
    return out


def histogram_summary(values: HistogramValues) -> dict[str, float]:
    """count, mean, std, min, max and the 5/25/50/75/95th percentiles: what a chart of scalars can show
    of a distribution over steps."""
    data = np.asarray(values, dtype=np.float64).reshape(-1)
    if data.size == 0:
        return {"count": 0.0}
    q = np.percentile(data, [5, 25, 50, 75, 95])
    return {
        "count": float(data.size),
        "mean": float(data.mean()),
        "std": float(data.std()),
        "min": float(data.min()),
        "max": float(data.max()),
        **{f"p{p:02d}": float(v) for p, v in zip((5, 25, 50, 75, 95), q, strict=True)},
    }


class StepFloor:
    """Drops writes for steps the backend already had before a resume (see the module docstring)."""

    def __init__(self, last_logged: int | None = None) -> None:
        self.last_logged = last_logged

    def allows(self, step: int) -> bool:
        return self.last_logged is None or step > self.last_logged


def check_resume_kind(resume: Mapping[str, Any], kind: str) -> None:
    if resume.get("kind") != kind:
        raise ValueError(
            f"cannot resume a {resume.get('kind')!r} tracker run with the {kind!r} tracker "
            f"(resume state {dict(resume)})"
        )
