"""`MlflowTracker`: runs, params and metrics in MLflow through `MlflowClient` (no global fluent state).

- Store: any tracking URI the full `mlflow` package opens: a local SQLite file (the default the builder
  picks, `sqlite:///<run dir>/mlflow.db`), a database, or an `mlflow server` (`http://host:5000`).
  MLflow 3's file store (`./mlruns`) refuses new runs, so it is never the default.
- Histograms are logged as summary-statistic metrics (`<name>/mean`, `/std`, `/min`, `/max`, `/p05` ...
  `/p95`, `/count`) rather than as artifacts: they chart over steps in the MLflow UI next to the scalars,
  stay queryable through the same API, and cost a few rows instead of one file per step.
- Resume: `resume_state()` holds the run id. Reopening it sets the run back to RUNNING, reads the last
  step already stored (over every metric key) and drops writes at or below it. MLflow params are
  immutable: on resume, params already stored are left alone, a changed value is reported in a warning
  and not written.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from d9d.tracking.protocol import (
    HistogramValues,
    RunSpec,
    RunStatus,
    StepFloor,
    check_resume_kind,
    flatten_params,
    histogram_summary,
)

_log = logging.getLogger(__name__)
_STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
_METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
_PARAMS_PER_BATCH = 100


class MlflowTracker:
    """Logs to `experiment` at `tracking_uri`; `artifact_location` applies when the experiment is new."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str = "d9d",
        artifact_location: str | None = None,
        disable_telemetry: bool = True,
    ) -> None:
        if disable_telemetry:  # an explicit MLFLOW_DISABLE_TELEMETRY in the environment still wins
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow import MlflowClient  # deferred: importing mlflow takes about a second

        # "Creating initial MLflow database tables..." on every new SQLite store: noise on a run's console.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)

        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self._artifact_location = artifact_location
        self._client = MlflowClient(tracking_uri=tracking_uri)
        self._run_id: str | None = None
        self._floor = StepFloor()

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def open(self, run: RunSpec, resume: Mapping[str, Any] | None = None) -> None:
        if self._run_id is not None:
            raise RuntimeError(f"MlflowTracker: run {self._run_id} is already open")
        params = {k: str(v) for k, v in flatten_params(run.params).items()}
        if resume is None:
            run_id = self._client.create_run(
                self._experiment_id(), run_name=run.name, tags=dict(run.tags)
            ).info.run_id
            existing: dict[str, str] = {}
        else:
            check_resume_kind(resume, "mlflow")
            run_id = str(resume["run_id"])
            try:
                stored = self._client.get_run(run_id)
            except Exception as err:
                raise RuntimeError(
                    f"MlflowTracker: cannot resume run {run_id} at {self.tracking_uri}: {err}"
                ) from err
            self._client.update_run(run_id, status="RUNNING")
            self._floor = StepFloor(self._last_step(run_id, list(stored.data.metrics)))
            existing = dict(stored.data.params)
            changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
            if changed:
                _log.warning(
                    "MLflow params are immutable; run %s keeps its old values of %s", run_id, changed
                )
        self._run_id = run_id
        self._log_params({k: v for k, v in params.items() if k not in existing})

    def resume_state(self) -> dict[str, Any]:
        if self._run_id is None:
            raise RuntimeError("MlflowTracker: no run is open")
        return {"kind": "mlflow", "run_id": self._run_id, "tracking_uri": self.tracking_uri}

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        run_id = self._require_open()
        if not self._floor.allows(step):
            return
        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in values.items()]
        for i in range(0, len(metrics), _METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=metrics[i : i + _METRICS_PER_BATCH])

    def log_histogram(self, step: int, name: str, values: HistogramValues) -> None:
        self.log_scalars(step, {f"{name}/{k}": v for k, v in histogram_summary(values).items()})

    def close(self, status: RunStatus = "finished") -> None:
        if self._run_id is None:
            return
        self._client.set_terminated(self._run_id, status=_STATUS[status])
        self._run_id = None

    def _require_open(self) -> str:
        if self._run_id is None:
            raise RuntimeError("MlflowTracker: call open() before logging")
        return self._run_id

    def _experiment_id(self) -> str:
        found = self._client.get_experiment_by_name(self.experiment)
        if found is not None:
            return str(found.experiment_id)
        return str(self._client.create_experiment(self.experiment, artifact_location=self._artifact_location))

    def _last_step(self, run_id: str, keys: list[str]) -> int | None:
        steps = [m.step for key in keys for m in self._client.get_metric_history(run_id, key)]
        return max(steps) if steps else None

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        assert self._run_id is not None
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            self._client.log_batch(self._run_id, params=items[i : i + _PARAMS_PER_BATCH])
