"""The job configuration: one pydantic tree, validated completely before any process group or actor exists.

Every section is frozen and forbids unknown keys, so a typo fails loudly with its dotted path instead of
being silently ignored. Providers (model, data, task, optimizer, LR scheduler) are chosen by built-in name
(a typed union: `d9d.engine.components`) or by import path (a plug-in checked against its protocol:
`d9d.engine.registry`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from d9d.core.cpu_affinity import CpuAffinityConfig
from d9d.core.mesh_params import DeviceMeshParameters
from d9d.core.storage import Location, StorageError, location
from d9d.engine.components import (
    AdamW,
    BuiltinModel,
    CausalLMTaskComponent,
    DataComponent,
    LRSchedulerComponent,
    OptimizerComponent,
    TaskComponent,
)
from d9d.engine.errors import ConfigError, format_validation_error
from d9d.engine.parallel_checks import (
    base_model,
    check_activation_checkpointing,
    check_cuda_graphs,
    check_fsdp_step_reduction,
    check_model_layout,
    cuda_graphs_hint,
)
from d9d.engine.registry import ModelComponent, validate_components
from d9d.modules.checkpointing import ActivationCheckpointingConfig, NoActivationCheckpointing
from d9d.parallel.compile import CompileConfig
from d9d.parallel.grad_sync import GradSyncConfig
from d9d.pipeline.schedule.config import (
    InferenceSchedule,
    OneFOneBSchedule,
    ScheduleConfig,
    build_schedule,
)
from d9d.tracking import TrackerConfig


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StorageConfig(_Section):
    """The durable root of runs (`run.storage`): a local or NFS directory, or an fsspec URI (`s3://bucket/
    prefix`, `gs://...`, `memory://...`). `options` go to the fsspec file system (for S3, e.g.
    `endpoint_url`, `key`, `secret`; credentials are better left to the environment). A run keeps its
    checkpoints, manifests, `latest`, `run_summary.json` and `run.json` under `<uri>/<run.name>/`, and
    copies of its tracker files, history, plot, logs and final export there (docs/engine.md)."""

    uri: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        return {"uri": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _check_opens(self) -> Self:
        self.root("check")
        return self

    def root(self, run_name: str) -> Location:
        """This run's durable directory; an unknown protocol or a missing `storage` extra fails here."""
        try:
            return location(self.uri, self.options) / run_name
        except StorageError as e:
            raise ValueError(f"run.storage.uri {self.uri!r}: {e}") from None


class RunConfig(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=128)
    description: str = ""
    hparams: dict[str, Any] = Field(default_factory=dict)
    # Where checkpoints, traces, the MLflow store and run_summary.json go. Default: runs/<name>.
    dir: Path | None = None
    # auto: continue from the newest verified commit if there is one; never: refuse to start when the
    # checkpoint directory holds committed work; required: refuse to start without a commit to continue.
    resume: Literal["auto", "never", "required"] = "auto"
    # A committed step directory (of a run with the same identity) to start from while this run's own
    # checkpoint directory holds no commit (`--resume-from`); once the run commits, its own commits win.
    resume_from: Path | None = None
    # The durable root for checkpoints, the run summary and copies of the tracker files and the export
    # (`StorageConfig`); None: everything stays in run.dir.
    storage: StorageConfig | None = None

    @property
    def resolved_dir(self) -> Path:
        return self.dir if self.dir is not None else Path("runs") / self.name


class BatchingConfig(_Section):
    """Global batch in samples per optimizer step; each DP rank runs microbatches of `microbatch_size`."""

    global_batch_size: int = Field(ge=1)
    microbatch_size: int = Field(ge=1)

    def gradient_accumulation(self, data_parallel: int) -> int:
        per_step = self.microbatch_size * data_parallel
        if self.global_batch_size % per_step != 0:
            raise ValueError(
                f"batching.global_batch_size={self.global_batch_size} is not divisible by "
                f"batching.microbatch_size × data parallel = {self.microbatch_size} × {data_parallel}"
            )
        return self.global_batch_size // per_step


class TrainerConfig(_Section):
    """`on_nonfinite`: what a step whose loss or gradient norm is NaN or infinite does (d9d.engine.nonfinite):
    `stop` the run with an error naming the step and the rank (default), `skip` its update (the step counts,
    its batches are consumed, parameters and optimizer state stay as they were), or `rollback` to the newest
    commit, skipping the batches since it (needs `checkpointing.period`). `max_nonfinite_steps`: with skip
    or rollback, the non-finite steps one launch attempt tolerates; the next one stops it as `stop` does."""

    total_steps: int = Field(ge=1)
    on_nonfinite: Literal["stop", "skip", "rollback"] = "stop"
    max_nonfinite_steps: int = Field(10, ge=1)


class DataLoadingConfig(_Section):
    """`num_workers`: 0 makes each step's batches on the step thread; 1 makes them on a background thread
    (`d9d.data.PrefetchingLoader`), `prefetch_factor` steps ahead (default 2), in the same order and with
    the same resume position. More than one worker is refused: a data provider is called from one thread."""

    num_workers: int = Field(0, ge=0)
    pin_memory: bool = False
    prefetch_factor: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_prefetch(self) -> Self:
        if self.num_workers > 1:
            raise ValueError(
                f"num_workers={self.num_workers}: data is made by one background thread (a data provider "
                "is called from one thread, in order); use num_workers: 1 and raise prefetch_factor to "
                "read further ahead"
            )
        if self.num_workers == 0 and self.prefetch_factor is not None:
            raise ValueError(
                "prefetch_factor only applies with a background loader; set num_workers: 1 or drop it"
            )
        return self

    @property
    def prefetch_depth(self) -> int:
        """Steps made ahead of training (0: on the step thread)."""
        if self.num_workers == 0:
            return 0
        return self.prefetch_factor if self.prefetch_factor is not None else 2


class EvalConfig(_Section):
    """Evaluation during training (`d9d.engine.evaluation`). `data`: the eval set's provider, the same shape
    as the top-level `data:`; `batch_size`: samples per eval batch over all data-parallel ranks; `batches`:
    batches per evaluation (the eval set is the first `batches × batch_size` samples, the same every time);
    `period`: evaluate every N steps (None: only at the end); `at_end`: evaluate after the last step."""

    data: DataComponent
    batch_size: int = Field(ge=1)
    batches: int = Field(1, ge=1)
    period: int | None = Field(None, ge=1)
    at_end: bool = True


class LoggingConfig(_Section):
    period: int = Field(1, ge=1)
    # Where metrics go (d9d.tracking); None = the launcher's default (stdout + metrics.jsonl without a
    # coordinator, MLflow in the run directory under Ray).
    tracker: TrackerConfig | None = None
    progress_bar: Literal["auto", "on", "off"] = "auto"


class CheckpointingConfig(_Section):
    # `async` is a Python keyword: the field is `async_save`, its key in job files and dumps is `async`.
    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    # Default: <run dir>/checkpoints.
    dir: Path | None = None
    # Save every `period` steps (None: only at the end when save_at_end).
    period: int | None = Field(None, ge=1)
    keep_last: int = Field(3, ge=1)
    save_at_end: bool = True
    # Export the final model in Hugging Face format here (via the model provider's state mapper).
    export_hf_dir: Path | None = None
    # Export even when the format cannot hold the model exactly (Qwen3-MoE's expert_bias: transformers'
    # logits will differ; `d9d export --inexact` measures by how much). False: such a config is refused.
    export_inexact: bool = False
    # Save only what training changes (trainable parameters, buffers, optimizer state). Frozen weights are
    # re-created on resume by the model provider's `initialize` (source checkpoint or seeded init).
    trainable_only: bool = False
    # A newest commit whose files do not match its manifest: resume from the previous verified commit
    # (fallback, with a warning naming the file) or stop with that error (fail).
    on_damaged: Literal["fallback", "fail"] = "fallback"
    # Write periodic checkpoints in the background: the step stalls only while the state is copied to
    # (pinned) host memory (d9d.engine.async_save). None: on when training on CUDA, off on CPU.
    async_save: bool | None = Field(None, alias="async")


class GradientClippingConfig(_Section):
    max_norm: float | None = Field(1.0, gt=0)


class DeterminismConfig(_Section):
    seed: int = 0


class GCConfig(_Section):
    # Run gc.collect() every N steps with automatic GC disabled (avoids random pauses on some ranks).
    period: int | None = Field(None, ge=1)
    # After the first step (model, optimizer state and compiled graphs built) move every object then alive
    # out of the cyclic collector's scans (`gc.freeze()`; undone when training ends). A full collection of a
    # compiled rank otherwise walks ~0.45M objects (229 ms on a 2-core VM for 28 layers; frozen 0.004 ms),
    # and in a multi-rank job one rank's pause stalls every other at the next collective (dense FSDP 4 steps
    # of 0.5-0.8 s against a 0.19 s median). Frozen objects are still freed by reference counting; only
    # reference cycles among them wait for the end of training.
    freeze: bool = True


class ProfilingConfig(_Section):
    enabled: bool = False
    wait: int = Field(1, ge=0)
    warmup: int = Field(1, ge=0)
    active: int = Field(2, ge=1)
    traces_dir: Path | None = None


class TimeoutsConfig(_Section):
    # Collective timeout while setting up and during the first step (loading, compilation) ...
    init_s: float = Field(600.0, gt=0)
    # ... and afterwards, so a hung rank surfaces quickly.
    step_s: float = Field(300.0, gt=0)


class TrainConfig(_Section):
    run: RunConfig
    mesh: DeviceMeshParameters = Field(default_factory=DeviceMeshParameters)
    batching: BatchingConfig
    trainer: TrainerConfig
    data_loading: DataLoadingConfig = Field(default_factory=DataLoadingConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    # The pipeline schedule (d9d.pipeline); None with pipeline_parallel > 1 means 1F1B.
    pipelining: ScheduleConfig | None = None
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    gradient_clipping: GradientClippingConfig = Field(default_factory=GradientClippingConfig)
    gradient_manager: GradSyncConfig = Field(default_factory=GradSyncConfig)
    determinism: DeterminismConfig = Field(default_factory=DeterminismConfig)
    gc: GCConfig = Field(default_factory=GCConfig)
    # Bind each rank's threads to CPUs near its GPU (d9d.core.cpu_affinity): mode none, node or exclusive.
    cpu_affinity: CpuAffinityConfig = Field(default_factory=CpuAffinityConfig)
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    # Regional torch.compile of every stage after it is parallelized (d9d.parallel.compile).
    compile: CompileConfig = Field(default_factory=CompileConfig)
    # Recompute decoder layers in backward instead of keeping their activations (d9d.modules.checkpointing):
    # mode none, full, or selective with `every: k` (every k-th layer whole), `ops: [matmul, attention]` (keep
    # those outputs in every layer, recompute the rest) or both (every k-th layer whole, the others op-level).
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=NoActivationCheckpointing)
    model: ModelComponent
    data: DataComponent
    task: TaskComponent = Field(default_factory=CausalLMTaskComponent)
    optimizer: OptimizerComponent = Field(default_factory=AdamW)
    lr_scheduler: LRSchedulerComponent | None = None
    # Validation loss/perplexity during training (None: no evaluation).
    eval: EvalConfig | None = None

    @model_validator(mode="after")
    def _check_eval(self) -> Self:
        if self.eval is None:
            return self
        pp = self.mesh.pipeline_parallel
        if pp > 1:
            # eval runs the training stages under a forward-only schedule: the same stages on each rank
            forward_only = InferenceSchedule(stages_per_rank=self.schedule.stages_per_rank)
            if forward_only.placement(pp) != self.schedule.placement(pp):
                raise ValueError(
                    f"eval with mesh.pipeline_parallel={pp} runs a forward-only schedule on the training "
                    f"stages, which needs a looped stage placement; pipelining.kind={self.schedule.kind} "
                    "places stages in a V (use 1f1b, gpipe, zb1p or interleaved_1f1b, or remove eval)"
                )
            try:
                build_schedule(forward_only, pp, self.eval.batches)
            except ValueError as e:
                raise ValueError(
                    f"eval (forward-only schedule, eval.batches={self.eval.batches}): {e}"
                ) from e
        if self.mesh.context_parallel > 1:
            raise ValueError(
                f"eval is not supported with context parallelism (mesh.context_parallel_replicate × "
                f"mesh.context_parallel_shard = {self.mesh.context_parallel} > 1): eval batches are not "
                "split over the sequence; remove the eval section or set both to 1"
            )
        if self.eval.batch_size % self.mesh.data_parallel != 0:
            raise ValueError(
                f"eval.batch_size={self.eval.batch_size} is not divisible by the data-parallel degree "
                f"{self.mesh.data_parallel} (mesh)"
            )
        return self

    @model_validator(mode="after")
    def _check_rollback(self) -> Self:
        if self.trainer.on_nonfinite == "rollback" and self.checkpointing.period is None:
            raise ValueError(
                "trainer.on_nonfinite=rollback goes back to the newest commit, so it needs periodic commits: "
                "set checkpointing.period (or use skip or stop)"
            )
        return self

    @model_validator(mode="after")
    def _check_trainable_only(self) -> Self:
        # The frozen weights a trainable-only checkpoint leaves out are re-created when resuming and
        # exporting. From a source checkpoint that is exact anywhere; a seeded random init is exact only on
        # the device kind and layout that drew it (CUDA and CPU generators differ, and so do plain and
        # sharded parameters' RNGs): `d9d export` on CPU of a CUDA run would silently get other weights.
        if not self.checkpointing.trainable_only:
            return self
        base, key = base_model(self.model)
        if isinstance(base, BuiltinModel) and base.options.source_checkpoint is None:
            raise ValueError(
                f"checkpointing.trainable_only with {key}.options.source_checkpoint unset: the frozen "
                "weights it does not save would be a seeded random init, re-created exactly only on the "
                "device and layout that drew it (not by `d9d export` on CPU, nor after a resume on another "
                f"layout); give {key}.options.source_checkpoint, or set checkpointing.trainable_only: false"
            )
        return self

    @model_validator(mode="after")
    def _check_batching(self) -> Self:
        accumulation = self.batching.gradient_accumulation(self.mesh.data_parallel)
        if self.mesh.pipeline_parallel > 1:
            try:
                build_schedule(self.schedule, self.mesh.pipeline_parallel, accumulation)
            except ValueError as e:
                raise ValueError(
                    f"pipelining ({self.schedule.kind}, {accumulation} microbatches per step): {e}"
                ) from e
        return self

    @model_validator(mode="after")
    def _check_checkpointing_schedule(self) -> Self:
        pp = self.mesh.pipeline_parallel
        if pp == 1 or getattr(self.activation_checkpointing, "ops", None) is None:
            return self
        accumulation = self.batching.gradient_accumulation(self.mesh.data_parallel)
        if build_schedule(self.schedule, pp, accumulation).splits_backward:
            raise ValueError(
                f"activation_checkpointing.ops with pipelining.kind={self.schedule.kind}: this schedule runs "
                "backward as two passes (input, then weights), and torch's selective checkpointing allows "
                "one backward through a checkpointed region; remove `ops` (`every: k` alone, or mode full) "
                "with it, or use a schedule without split backward (1f1b, interleaved_1f1b, gpipe)"
            )
        return self

    @model_validator(mode="after")
    def _check_deferred_weight_grads(self) -> Self:
        if not self.compile.defer_weight_grads:
            return self
        pp = self.mesh.pipeline_parallel
        if pp == 1:
            raise ValueError(
                "compile.defer_weight_grads without pipelining (mesh.pipeline_parallel = 1): it defers the "
                "compiled blocks' weight gradients to a zero-bubble schedule's weight pass, and a job "
                "without pipeline stages has none; remove it, or pipeline with pipelining.kind zb1p, zbv or "
                "dualpipev"
            )
        accumulation = self.batching.gradient_accumulation(self.mesh.data_parallel)
        if not build_schedule(self.schedule, pp, accumulation).splits_backward:
            raise ValueError(
                f"compile.defer_weight_grads with pipelining.kind={self.schedule.kind}: this schedule runs "
                "backward in one pass, so there is no weight pass to defer to and the option would only add "
                "graph breaks; remove it, or use a schedule that splits backward (zb1p, zbv, dualpipev)"
            )
        return self

    @model_validator(mode="after")
    def _check_context_parallel(self) -> Self:
        check_model_layout(self.mesh, self.model, self.data, self.task, self.schedule.stages_per_rank)
        check_fsdp_step_reduction(
            self.mesh,
            self.model,
            self.gradient_manager,
            self.batching.gradient_accumulation(self.mesh.data_parallel),
        )
        check_activation_checkpointing(self.mesh, self.model, self.activation_checkpointing, self.compile)
        check_cuda_graphs(
            self.mesh,
            self.model,
            self.compile,
            self.activation_checkpointing,
            self.schedule.kind,
            evaluates=self.eval is not None,
        )
        return self

    def cuda_graphs_hint(self, microbatches: int) -> str | None:
        """`d9d.engine.parallel_checks.cuda_graphs_hint` for this job, at `microbatches` per rank and step."""
        return cuda_graphs_hint(
            self.mesh,
            self.model,
            self.compile,
            self.activation_checkpointing,
            self.schedule.kind,
            evaluates=self.eval is not None,
            microbatches=microbatches,
        )

    @property
    def schedule(self) -> ScheduleConfig:
        return self.pipelining if self.pipelining is not None else OneFOneBSchedule()

    @property
    def run_dir(self) -> Path:
        return self.run.resolved_dir

    @property
    def storage_root(self) -> Location:
        """Where the run's durable files go: `run.storage` / run.name, or run.dir without one."""
        storage = self.run.storage
        return storage.root(self.run.name) if storage is not None else self.run_dir

    @property
    def checkpoint_dir(self) -> Location:
        if self.checkpointing.dir is not None:
            return self.checkpointing.dir
        return self.storage_root / "checkpoints"


__all__ = [
    "MAX_ALIAS_VALUES",
    "MAX_CONFIG_BYTES",
    "ConfigError",
    "TrainConfig",
    "apply_overrides",
    "check_expansion",
    "format_validation_error",
    "load_config",
    "load_yaml",
    "parse_config",
]


#: Input bounds (docs/engine.md, "Bounded inputs"): a job file, one `--set` value, all `--set` values of a
#: command, and the values YAML aliases (`*name`) may add by repeating what an anchor (`&name`) holds.
MAX_CONFIG_BYTES = 4 * 2**20
MAX_OVERRIDE_BYTES = 64 * 2**10
MAX_OVERRIDES_BYTES = 2**20
MAX_ALIAS_VALUES = 100_000
MAX_DEPTH = 64


def check_expansion(value: Any, source: str) -> None:
    """Refuse a structure whose shared parts (YAML aliases, or one object placed twice) repeat more than
    `MAX_ALIAS_VALUES` values, that refers to itself, or that nests deeper than `MAX_DEPTH`. Counted over
    the shared structure itself (each part once), so an alias bomb is refused without being expanded."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    repeated = 0

    def size(node: Any, depth: int) -> int:
        nonlocal repeated
        if not isinstance(node, dict | list):
            return 1
        key = id(node)
        if key in active:
            raise ConfigError(f"{source}: a YAML alias refers to a node that contains it (a recursive value)")
        if key in sizes:
            repeated += sizes[key]
            if repeated > MAX_ALIAS_VALUES:
                raise ConfigError(
                    f"{source}: YAML aliases (*name) expand to more than {MAX_ALIAS_VALUES:,} repeated "
                    "values; refused (an alias bomb?). Write the values out, or repeat less"
                )
            return sizes[key]
        if depth > MAX_DEPTH:
            raise ConfigError(f"{source}: nested more than {MAX_DEPTH} levels deep; refused")
        active.add(key)
        children = node.values() if isinstance(node, dict) else node
        total = 1 + sum(size(child, depth + 1) for child in children)
        active.discard(key)
        sizes[key] = total
        return total

    size(value, 0)


def load_yaml(text: str, source: str) -> Any:
    """`yaml.safe_load` (no `!!python/...` tags) with the bounds above; errors name `source`."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _yaml_error(e, source) from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to parse; refused") from None
    check_expansion(value, source)
    return value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; values are parsed as YAML scalars (`3`, `1e-4`, `true`, `[1, 2]`).
    Each override is at most `MAX_OVERRIDE_BYTES`, all of them `MAX_OVERRIDES_BYTES`; the result is checked
    against the alias bounds before it is copied."""
    total = sum(len(item.encode()) for item in overrides)
    if total > MAX_OVERRIDES_BYTES:
        raise ConfigError(
            f"--set values are {total:,} bytes together, more than the {MAX_OVERRIDES_BYTES:,} allowed; put "
            "large settings in the job file"
        )
    check_expansion(data, "the job config")
    out: dict[str, Any] = json.loads(json.dumps(data, default=str))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        if len(item.encode()) > MAX_OVERRIDE_BYTES:
            raise ConfigError(
                f"--set {key}: the value is {len(raw.encode()):,} bytes, more than the "
                f"{MAX_OVERRIDE_BYTES:,} one override may have; put it in the job file"
            )
        if "[" in key:  # `paths[0]=x` would otherwise become a new key `paths[0]`, refused as unknown
            raise ConfigError(
                f"override {item!r}: list items cannot be set one at a time; give the whole list, e.g. "
                f"--set '{key.partition('[')[0]}=[a, b]'"
            )
        node = out
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: depth + 1])} is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(raw, f"--set {key} value {raw!r}")
    check_expansion(out, "the job config with its --set overrides")
    return out


def _yaml_error(error: yaml.YAMLError, source: str) -> ConfigError:
    """`error` as `source:line:column: problem` (1-based, as editors count); PyYAML itself names the
    text `<unicode string>` and prints a context block."""
    mark = error.problem_mark if isinstance(error, yaml.MarkedYAMLError) else None
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    problem = (error.problem if isinstance(error, yaml.MarkedYAMLError) else None) or str(error)
    context = error.context if isinstance(error, yaml.MarkedYAMLError) else None
    return ConfigError(f"{where}: malformed YAML: {problem}" + (f" ({context})" if context else ""))


def _parse_scalar(raw: str, source: str) -> Any:
    value = load_yaml(raw, source)
    if isinstance(value, str):
        # YAML 1.1 reads "1e-4" (no dot) as a string; users mean a number.
        try:
            return float(raw)
        except ValueError:
            return value
    return value


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config file {p} is {size:,} bytes, more than the {MAX_CONFIG_BYTES:,} a job file may have; "
                "refused before parsing (keep data out of the job file: point at it by path)"
            )
        with p.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)  # the file may have grown since stat
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {p} is more than {MAX_CONFIG_BYTES:,} bytes; refused")
        text = raw.decode()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} cannot be read: {e}") from None
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}") from None
        except RecursionError:
            raise ConfigError(f"{p}: nested too deeply to parse; refused") from None
        check_expansion(data, str(p))
    else:
        data = load_yaml(text, str(p))
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must contain a mapping at the top level")
    return data


def parse_config(data: Mapping[str, Any], *, check_components: bool = True) -> TrainConfig:
    """Validate a config mapping; with `check_components`, also import plug-ins and check them and their
    options (built-in options are always checked: they are part of the schema)."""
    try:
        config = TrainConfig.model_validate(dict(data))
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, data=data)) from None
    if check_components:
        validate_components(config)
    return config


def load_config(
    path: str | Path, overrides: Sequence[str] = (), *, ignore_sections: Sequence[str] = ()
) -> TrainConfig:
    """Read YAML/JSON, apply `--set` overrides, validate everything. `ignore_sections` are dropped first
    (the cluster layer owns a top-level `cluster:` section that the engine does not know)."""
    data = apply_overrides(read_config_file(path), overrides)
    for section in ignore_sections:
        data.pop(section, None)
    return parse_config(data)
