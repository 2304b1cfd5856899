"""A job, validated end to end on the driver before any actor exists.

The job file is the engine's `TrainConfig` plus a top-level `cluster:` section. Loading it validates both
(including the providers the engine will build and the world sizes the job may run at), resolves the
run and checkpoint directories to absolute paths (rank actors may start in another working directory),
and freezes the result into a `JobSpec` that travels to the coordinator.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from d9d.cluster.config import ENGINE_ENTRYPOINT, ClusterConfig, CoordinatorStorage
from d9d.cluster.elastic import WorldPlan, plan_for, valid_plans
from d9d.cluster.reach import check_submitted_paths
from d9d.cluster.runtime_env import RuntimeEnvConfig, import_paths, with_runtime_env
from d9d.core.storage import Location, is_uri
from d9d.engine.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    format_validation_error,
    parse_config,
    read_config_file,
)
from d9d.tracking import TrackerConfig, TrackerError, check_tracker


@dataclass(frozen=True)
class JobSpec:
    cluster: ClusterConfig
    train: TrainConfig  # run.dir and checkpointing.dir are absolute

    @property
    def run_name(self) -> str:
        return self.train.run.name

    @property
    def run_dir(self) -> Path:
        return self.train.run_dir

    @property
    def storage_root(self) -> Location:
        """The run's durable files: checkpoints and `run_summary.json` (`run.storage`, else run.dir)."""
        return self.train.storage_root

    @property
    def checkpoint_dir(self) -> Location:
        """Where committed checkpoints live (on the coordinator's node in coordinator-storage mode)."""
        return self.train.checkpoint_dir

    @property
    def initial_workers(self) -> int:
        return self.cluster.num_workers or self.train.mesh.world_size

    @property
    def min_workers(self) -> int:
        return self.cluster.min_workers or self.initial_workers

    @property
    def max_workers(self) -> int:
        return self.cluster.max_workers or self.initial_workers

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers

    @property
    def init_timeout_s(self) -> float:
        return self.cluster.init_timeout_s or self.train.timeouts.init_s

    @property
    def step_timeout_s(self) -> float:
        return self.cluster.step_timeout_s or self.train.timeouts.step_s

    def plan(self, workers: int) -> WorldPlan:
        return plan_for(self.train.mesh, self.train.batching, workers)

    def plans(self, max_workers: int | None = None) -> list[WorldPlan]:
        """Valid layouts between min_workers and `max_workers` (default: the configured maximum)."""
        hi = self.max_workers if max_workers is None else max_workers
        return valid_plans(self.train.mesh, self.train.batching, self.min_workers, hi)

    def rank_config(self, rank: int) -> dict[str, Any]:
        """The engine config one rank runs with (JSON-able)."""
        data = self.train.model_dump(mode="json")
        storage = self.cluster.storage
        if isinstance(storage, CoordinatorStorage):
            data["checkpointing"]["dir"] = str(self.local_checkpoint_dir(rank))
        return data

    def local_checkpoint_dir(self, rank: int) -> Path:
        """A rank's node-local checkpoint scratch in coordinator-storage mode."""
        storage = self.cluster.storage
        assert isinstance(storage, CoordinatorStorage)
        root = storage.local_dir or Path(tempfile.gettempdir()) / "d9d"
        return (root / self.run_name / f"rank-{rank:05d}").resolve()


def load_job(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    num_workers: int | None = None,
    cpu: bool = False,
    runtime_env: RuntimeEnvConfig | None = None,
) -> JobSpec:
    """Read, override and validate a job file; raise `ConfigError` naming the offending key. `runtime_env`
    (the command line's) is merged over the file's `cluster.runtime_env`."""
    data = with_runtime_env(apply_overrides(read_config_file(path), overrides), runtime_env)
    return build_job(data, num_workers=num_workers, cpu=cpu)


def build_job(data: dict[str, Any], *, num_workers: int | None = None, cpu: bool = False) -> JobSpec:
    data = dict(data)
    cluster_data = dict(data.pop("cluster", None) or {})
    if num_workers is not None:
        cluster_data["num_workers"] = num_workers
    if cpu:
        cluster_data["resources"] = {**dict(cluster_data.get("resources") or {}), "gpus": 0}
    try:
        cluster = ClusterConfig.model_validate(cluster_data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix="cluster")) from None
    # The engine's provider protocols are checked for the built-in engine; a custom entrypoint defines
    # what its provider sections mean.
    with import_paths(cluster.runtime_env):  # plug-ins may live in the runtime env's local packages
        train = parse_config(data, check_components=cluster.entrypoint == ENGINE_ENTRYPOINT)
    absolute = train.model_dump(mode="json")
    absolute["run"]["dir"] = str(train.run_dir.resolve())
    if isinstance(train.checkpoint_dir, Path):
        absolute["checkpointing"]["dir"] = str(train.checkpoint_dir.resolve())
    elif isinstance(cluster.storage, CoordinatorStorage):
        raise ConfigError(
            f"run.storage {train.checkpoint_dir.parent} is an object store, and cluster.storage.kind="
            "coordinator keeps checkpoints on the coordinator's node: use one or the other"
        )
    storage = train.run.storage
    if storage is not None and not is_uri(storage.uri):
        absolute["run"]["storage"]["uri"] = str(Path(storage.uri).expanduser().resolve())
    if train.run.resume_from is not None:
        absolute["run"]["resume_from"] = str(train.run.resume_from.resolve())
    if train.checkpointing.export_hf_dir is not None:
        absolute["checkpointing"]["export_hf_dir"] = str(train.checkpointing.export_hf_dir.resolve())
    spec = JobSpec(cluster=cluster, train=parse_config(absolute, check_components=False))
    check_submitted_paths()
    _check_world_sizes(spec)
    try:
        check_tracker(tracker_config(spec), spec.run_dir)
    except TrackerError as e:
        raise ConfigError(str(e)) from None
    return spec


def tracker_config(spec: JobSpec) -> TrackerConfig:
    """`logging.tracker`, written by the coordinator; MLflow (SQLite in the run directory) when unset."""
    try:
        return TypeAdapter(TrackerConfig).validate_python(spec.train.logging.tracker or {"kind": "mlflow"})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix="logging.tracker")) from None


def _check_world_sizes(spec: JobSpec) -> None:
    try:
        spec.plan(spec.initial_workers)
    except ValueError as e:
        field = "cluster.num_workers" if spec.cluster.num_workers is not None else "mesh"
        raise ConfigError(f"{field}: cannot run on {spec.initial_workers} ranks: {e}") from None
    if spec.elastic and not spec.plans():
        raise ConfigError(
            f"cluster.min_workers/max_workers: no valid world size between {spec.min_workers} and "
            f"{spec.max_workers}"
        )
