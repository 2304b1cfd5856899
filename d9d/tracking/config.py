"""Tracker configs: one pydantic model per backend, selected by `kind`.

`logging.tracker` takes one of them, or a list (several trackers at once: the list becomes a `multi` config).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


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


class TensorBoardTrackerConfig(_Config):
    kind: Literal["tensorboard"] = "tensorboard"
    #: Event-file directory, relative to the run directory (an absolute path is kept).
    log_dir: str = Field("tensorboard", min_length=1)
    #: How often the writer thread flushes events to disk; `close` always flushes.
    flush_secs: float = Field(10.0, gt=0)


class WandbTrackerConfig(_Config):
    kind: Literal["wandb"] = "wandb"
    project: str = Field("d9d", min_length=1)
    entity: str | None = None
    #: None: `$WANDB_MODE`, else "offline" (nothing leaves the machine until `wandb sync`).
    mode: Literal["online", "offline"] | None = None
    #: Where W&B puts its `wandb/` folder, relative to the run directory.
    dir: str = "."
    tags: tuple[str, ...] = ()


class NullTrackerConfig(_Config):
    kind: Literal["null"] = "null"


SingleTrackerConfig = Annotated[
    MlflowTrackerConfig
    | LogTrackerConfig
    | TensorBoardTrackerConfig
    | WandbTrackerConfig
    | NullTrackerConfig,
    Field(discriminator="kind"),
]


class MultiTrackerConfig(_Config):
    """Several trackers fed the same metrics (e.g. MLflow and TensorBoard)."""

    kind: Literal["multi"] = "multi"
    trackers: tuple[SingleTrackerConfig, ...] = Field(min_length=1)


def _list_is_multi(value: Any) -> Any:
    """`tracker: [{kind: mlflow}, {kind: tensorboard}]` is `{kind: multi, trackers: [...]}`."""
    if isinstance(value, list | tuple):
        return {"kind": "multi", "trackers": list(value)}
    return value


TrackerConfig = Annotated[
    MlflowTrackerConfig
    | LogTrackerConfig
    | TensorBoardTrackerConfig
    | WandbTrackerConfig
    | NullTrackerConfig
    | MultiTrackerConfig,
    Field(discriminator="kind"),
    BeforeValidator(_list_is_multi),
]
