"""Tracker configs: one pydantic model per backend, selected by `kind`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MlflowTrackerConfig(_Config):
    kind: Literal["mlflow"] = "mlflow"
    #: None: `$MLFLOW_TRACKING_URI`, else `sqlite:///<run dir>/mlflow.db` with artifacts in
    #: `<run dir>/mlartifacts`.
    tracking_uri: str | None = None
    experiment: str = Field("d9d", min_length=1)
    #: Sets MLFLOW_DISABLE_TELEMETRY=true unless the environment already sets it.
    disable_telemetry: bool = True


class LogTrackerConfig(_Config):
    kind: Literal["log"] = "log"
    stdout: bool = True
    #: JSON-lines file, relative to the run directory; None writes no file.
    jsonl: str | None = "metrics.jsonl"
    histogram_bins: int = Field(64, ge=1)


class NullTrackerConfig(_Config):
    kind: Literal["null"] = "null"


TrackerConfig = Annotated[
    MlflowTrackerConfig | LogTrackerConfig | NullTrackerConfig, Field(discriminator="kind")
]
