"""`WandbTracker`: Weights & Biases runs, online or offline.

- Offline (the default unless `$WANDB_MODE` or `mode` says otherwise) writes the run under
  `<dir>/wandb/offline-run-*`; `wandb sync <that dir>` uploads it later. Nothing leaves the machine.
- W&B's console capture and system-metrics sampler are off: d9d reports device memory and step times itself
  (under `system/`), and the tracker's process is the coordinator, whose stdout is not the training's.
- Resume: `resume_state()` holds the run id; reopening passes it back with `resume="allow"`.
- `close` stops W&B's service process of this process (the only way to wait until an offline run is on
  disk); a later `open` starts a new one.
- W&B's step only moves forward: values for a step below the last one logged (say a task metric finished
  late) are dropped here rather than by W&B with a warning; more values for the current step join its row.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from d9d.tracking.protocol import (
    HistogramValues,
    RunSpec,
    RunStatus,
    StepFloor,
    check_resume_kind,
    flatten_params,
)

_EXIT_CODE = {"finished": 0, "failed": 1, "killed": 1}


class WandbTracker:
    def __init__(
        self,
        directory: Path,
        project: str = "d9d",
        entity: str | None = None,
        mode: Literal["online", "offline"] = "offline",
        tags: tuple[str, ...] = (),
        histogram_bins: int = 64,
    ) -> None:
        self.directory = directory
        self.project = project
        self.entity = entity
        self.mode = mode
        self._tags = tags
        self._bins = histogram_bins
        self._run: Any = None
        self._floor = StepFloor()
        self._last: int | None = None  # W&B drops a step below the one it last saw

    @property
    def run_dir(self) -> Path | None:
        """The run's own folder (`.../wandb/offline-run-<time>-<id>`), once open."""
        return None if self._run is None else Path(self._run.dir).parent

    def open(self, run: RunSpec, resume: Mapping[str, Any] | None = None) -> None:
        import wandb

        if self._run is not None:
            raise RuntimeError(f"WandbTracker: run {self._run.id} is already open")
        run_id: str | None = None
        if resume is not None:
            check_resume_kind(resume, "wandb")
            run_id = str(resume["run_id"])
        self.directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=run.name,
            dir=str(self.directory),
            mode=self.mode,
            config=flatten_params(run.params),
            tags=[*self._tags, *(f"{k}={v}" for k, v in run.tags.items())],
            id=run_id,
            resume="allow" if run_id is not None else None,
            settings=settings,
            reinit="create_new",  # several trackers (or tests) in one process must not share a run
        )

    def resume_state(self) -> dict[str, Any]:
        if self._run is None:
            raise RuntimeError("WandbTracker: no run is open")
        return {"kind": "wandb", "run_id": str(self._run.id), "project": self.project}

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        run = self._require_open()
        if not self._allows(step):
            return
        run.log({k: float(v) for k, v in values.items()}, step=step)

    def log_histogram(self, step: int, name: str, values: HistogramValues) -> None:
        import wandb

        run = self._require_open()
        if not self._allows(step):
            return
        data = np.asarray(values, dtype=np.float64).reshape(-1)
        if data.size == 0:
            return
        counts, edges = np.histogram(data, bins=min(self._bins, 512))  # W&B's histogram limit
        run.log({name: wandb.Histogram(np_histogram=(counts, edges))}, step=step)

    def close(self, status: RunStatus = "finished") -> None:
        if self._run is None:
            return
        import wandb

        self._run.finish(exit_code=_EXIT_CODE[status])
        self._run = None
        # `finish` returns before W&B's service process has written the run's last records; stopping the
        # service waits for them, so the run on disk is complete once `close` returns.
        wandb.teardown()

    def _allows(self, step: int) -> bool:
        if not self._floor.allows(step) or (self._last is not None and step < self._last):
            return False
        self._last = step
        return True

    def _require_open(self) -> Any:
        if self._run is None:
            raise RuntimeError("WandbTracker: call open() before logging")
        return self._run


def wandb_mode(configured: Literal["online", "offline"] | None) -> Literal["online", "offline"]:
    """The config's mode, else `$WANDB_MODE` (online/offline; anything else: offline)."""
    if configured is not None:
        return configured
    return "online" if os.environ.get("WANDB_MODE") == "online" else "offline"
