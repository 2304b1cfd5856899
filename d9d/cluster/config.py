"""The `cluster:` section of a job file: how many rank actors, what each reserves, where checkpoints live,
and how failures are handled. Everything else in the file is the engine's `TrainConfig`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.cluster.runtime_env import RuntimeEnvConfig

# The built-in engine; a custom entrypoint reads the provider sections its own way.
ENGINE_ENTRYPOINT = "d9d.engine.launch:run_rank"
# A rank is declared dead after this many heartbeat intervals at the least: one late beat (a GC pause, a
# busy node) must not look like a dead process.
MIN_HEARTBEATS_PER_TIMEOUT = 3


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RankResources(_Section):
    """What one rank actor reserves (one placement-group bundle)."""

    cpus: float = Field(1.0, gt=0)
    # 0: CPU ranks on gloo; 1: one GPU per rank, NCCL with gloo alongside.
    gpus: Literal[0, 1] = 0


class SharedStorage(_Section):
    """Every node sees `checkpointing.dir` (NFS, Lustre, a fuse-mounted bucket): ranks write in place."""

    kind: Literal["shared"] = "shared"


class CoordinatorStorage(_Section):
    """No shared filesystem: ranks write to node-local scratch and upload their files in the background,
    through the Ray object store, to a storage actor on the coordinator's node, which keeps the committed
    steps under `checkpointing.dir` and serves a restarted rank the files it reads (d9d.cluster.transfer)."""

    kind: Literal["coordinator"] = "coordinator"
    # Node-local scratch for each rank's checkpoint files; default: <system temp>/d9d/<run name>.
    local_dir: Path | None = None
    chunk_mb: int = Field(64, ge=1)


StorageConfig = Annotated[SharedStorage | CoordinatorStorage, Field(discriminator="kind")]


class ClusterConfig(_Section):
    # Callable `entrypoint(config: dict, runtime: RankRuntime, reporter: RunReporter) -> RankResult`.
    entrypoint: str = Field(ENGINE_ENTRYPOINT, pattern=r"^[\w.]+:[\w.]+$")
    # Rank actors (the world size). Default: the mesh's world size. A different value changes only the
    # data-parallel degree; min/max bound elastic restarts (default: no elasticity).
    num_workers: int | None = Field(None, ge=1)
    min_workers: int | None = Field(None, ge=1)
    max_workers: int | None = Field(None, ge=1)
    resources: RankResources = Field(default_factory=RankResources)
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD"] = "PACK"
    # How long to wait for a placement group of one size before trying the next smaller valid size.
    placement_timeout_s: float = Field(60.0, gt=0)
    storage: StorageConfig = Field(default_factory=SharedStorage)
    # Failures (rank death, hang, engine error) tolerated before the job fails.
    max_failures: int = Field(3, ge=0)
    # Wait before restart k (k = 1, 2, ...): min(restart_backoff_s * 2**(k-1), max_backoff_s).
    restart_backoff_s: float = Field(1.0, ge=0)
    max_backoff_s: float = Field(30.0, ge=0)
    heartbeat_interval_s: float = Field(0.5, gt=0)
    # A rank whose heartbeats stop for this long is declared dead (a frozen process, a lost node the
    # Ray health check has not reported yet).
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    # No step boundary for this long counts as a hang; default: the engine's timeouts.init_s until the
    # first step completes, timeouts.step_s afterwards.
    init_timeout_s: float | None = Field(None, gt=0)
    step_timeout_s: float | None = Field(None, gt=0)
    # Where each rank's stdout/stderr goes: "files" (<run dir>/logs/rank<r>.log; the console shows only the
    # coordinator's progress) or "forward" (to the driver through Ray, as `d9d train --verbose` sets).
    rank_output: Literal["files", "forward"] = "files"
    # Warm standby rank actors kept started (imports done), each in a one-bundle placement group of its own
    # with a rank's resources; a restart uses them in place of cold processes (docs/cluster.md).
    standby_ranks: int = Field(0, ge=0)
    # A storage operation (a checkpoint file written, on a rank or the coordinator) in flight this long is
    # named on the console (which file, which store, how long), and again every this long while it lasts.
    storage_stall_s: float = Field(10.0, gt=0)
    # SIGTERM/SIGINT to `d9d train` (a preemption, `ray job stop`), or Ray draining the node of a rank or of
    # the coordinator (a preemption notice, `d9d.cluster.drain`): the ranks stop at the next step boundary
    # and save it; if they have not within this long (or by the drain's deadline, if sooner), they are killed
    # (the steps since the last commit are then lost). Keep it below the scheduler's kill delay (Kubernetes'
    # terminationGracePeriodSeconds, SLURM's KillWait), both 30 s by default.
    preemption_grace_s: float = Field(25.0, gt=0)
    # Detach the coordinator from the driver: closing `d9d train` or the notebook does not stop training.
    detach: bool = False
    # A detached coordinator stays this long after the job ended so clients can fetch the result.
    linger_s: float = Field(600.0, ge=0)
    # Ray runtime environment of the coordinator and the ranks (local packages, pip, env vars); see
    # d9d.cluster.runtime_env. `d9d submit` moves it to the Ray job's own runtime environment.
    runtime_env: RuntimeEnvConfig | None = None

    @model_validator(mode="after")
    def _check_workers(self) -> Self:
        lo, hi, n = self.min_workers, self.max_workers, self.num_workers
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"cluster.min_workers={lo} is larger than cluster.max_workers={hi}")
        if n is not None and lo is not None and n < lo:
            raise ValueError(f"cluster.num_workers={n} is smaller than cluster.min_workers={lo}")
        if n is not None and hi is not None and n > hi:
            raise ValueError(f"cluster.num_workers={n} is larger than cluster.max_workers={hi}")
        return self

    @model_validator(mode="after")
    def _check_heartbeats(self) -> Self:
        interval, timeout = self.heartbeat_interval_s, self.heartbeat_timeout_s
        if timeout < MIN_HEARTBEATS_PER_TIMEOUT * interval:
            raise ValueError(
                f"cluster.heartbeat_timeout_s={timeout} must be at least {MIN_HEARTBEATS_PER_TIMEOUT} × "
                f"cluster.heartbeat_interval_s={interval}: a rank would be declared dead after one late "
                "heartbeat"
            )
        return self
