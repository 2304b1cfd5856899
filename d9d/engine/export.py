"""Hugging Face exports from a committed training checkpoint, in one process and without a process group.

The checkpoint's step directory holds the job config that wrote it (`train_config.json`), so the model is
rebuilt exactly as training built it: every pipeline stage by the same model provider, initialized under
the seed its pipeline rank used (frozen weights of a `trainable_only` checkpoint are re-created the same
way, or from the base's source checkpoint), then the saved model state is read through DCP (which
reassembles FSDP/expert shards into whole tensors). The provider's own export writes the result: merged
weights (`export`, with PEFT adapters folded in) or a `peft` adapter directory.

An export is written to a local directory (the writer renames it into place whole), then, for a run with a
storage root elsewhere (`run.storage`) or a `d9d export --hf s3://...`, copied there (`publish_export`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain, compute_layout
from d9d.core.storage import AnyLocation, Location, StoragePath, copy_tree
from d9d.determinism import RankSeeds, stage_seed
from d9d.engine.builtin.models import CausalLMProvider
from d9d.engine.builtin.peft import PeftModelProvider
from d9d.engine.checkpoint import (
    LATEST,
    TRAIN_CONFIG,
    CheckpointError,
    dcp_files,
    dcp_problem,
    is_committed,
    read_latest,
    require_listed,
    step_dir_name,
    verify_manifest,
)
from d9d.engine.checkpoint_io import SafeLoadPlanner, safe_reader
from d9d.engine.config import ConfigError, TrainConfig, apply_overrides, parse_config, read_config_file
from d9d.engine.providers import ModelProvider
from d9d.engine.registry import build_model, export_gap, plugins
from d9d.engine.stages import build_stages
from d9d.modules.moe import TopKRouter
from d9d.parallel.compile import CompileConfig
from d9d.peft import trainable_state_dict
from d9d.pipeline.api import PipelineStageInfo

ExportKind = Literal["merged", "adapter"]
#: Where the final export of a run with `run.storage` is copied, under its storage root.
EXPORT_DIR = "export"


def storage_export_dir(config: TrainConfig) -> Location | None:
    """`<storage root>/export` for a run with `run.storage`; None when its durable files stay in run.dir."""
    return None if config.run.storage is None else config.storage_root / EXPORT_DIR


def publish_export(local: Path, target: Location) -> Location:
    """Copy the export at `local` to `target` (weights before the JSON files that name them); files an
    earlier export left there and this one lacks are removed. Nothing is copied when they are one place."""
    copy_tree(local, target)
    return target


def checkpoint_root(run: AnyLocation) -> AnyLocation:
    """The checkpoint root of a run: `RUN/checkpoints`, or `run` itself when it holds `latest`/steps. `run`
    may be a storage root (`s3://bucket/runs/<run>`)."""
    if (run / LATEST).exists() or any(run.glob("step-*")):
        return run
    root = run / "checkpoints"
    if root.is_dir():
        return root
    raise CheckpointError(f"{run}: no checkpoints (looked for {root} and for {LATEST} in {run})")


def find_step(run: Location, step: int | None) -> Location:
    """The committed step directory of `run` (a run directory or a checkpoint root): `step`, else latest;
    verified against its manifest (`verify_step`) before anything in it is read."""
    match run:  # one call per kind: a Path's steps are Paths, a StoragePath's are StoragePaths
        case Path():
            return _find_step(run, step)
        case StoragePath():
            return _find_step(run, step)


def verify_step(step_dir: Location) -> None:
    """What every reader of a commit outside training does first: every file listed in the manifest
    matches its size and sha256, and the manifest lists `.metadata` and every data file it points at."""
    try:
        manifest = verify_manifest(step_dir)
        dcp_files(step_dir, manifest)
    except CheckpointError as e:
        raise CheckpointError(f"{step_dir} does not verify, refusing to read it: {e}") from None


def _find_step(run: AnyLocation, step: int | None) -> AnyLocation:
    step_dir = _committed_step(run, step)
    verify_step(step_dir)
    return step_dir


def _committed_step(run: AnyLocation, step: int | None) -> AnyLocation:
    root = checkpoint_root(run)
    if step is None:
        latest = read_latest(root)
        if latest is None:
            raise CheckpointError(f"{root}: nothing was committed yet (no {LATEST})")
        return latest
    step_dir = root / step_dir_name(step)
    if not is_committed(step_dir):
        committed = sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*") if is_committed(p))
        raise CheckpointError(
            f"{root}: step {step} is not a committed checkpoint; committed steps: "
            f"{', '.join(map(str, committed)) or 'none'}"
        )
    return step_dir


def model_config(data: dict[str, Any]) -> TrainConfig:
    """A job config as an export needs it: the whole tree validated, but of the plug-ins only the model's
    imported and checked. Rebuilding the weights needs the model (and the mesh and seed its stages were
    built with); the data provider, task and optimizer a run trained with need not be importable where it
    is exported (`examples.lora_sft.data` outside the repository, say)."""
    data = {k: v for k, v in data.items() if k != "cluster"}
    config = parse_config(data, check_components=False)
    for field, plugin in plugins(config):
        if field.startswith("model"):
            plugin.check(field)
    return config


def load_model_config(path: Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """`model_config` of a job file with `--set` overrides applied."""
    return model_config(apply_overrides(read_config_file(path), overrides))


def read_train_config(step_dir: Location) -> TrainConfig:
    """The job config saved with the step (`model_config`: only the model's plug-ins must import here)."""
    path = step_dir / TRAIN_CONFIG
    if not path.is_file():
        raise ConfigError(
            f"{step_dir} has no {TRAIN_CONFIG} (written by d9d since the export command exists); "
            "pass the job file that trained it with --config"
        )
    require_listed(step_dir, [TRAIN_CONFIG])
    data: dict[str, Any] = json.loads(path.read_text())
    return model_config(data)


@dataclass(frozen=True)
class _Stage:
    info: PipelineStageInfo
    seed: int


def _stages(config: TrainConfig) -> list[_Stage]:
    """Every stage of the model with the parameter seed the rank holding it used in training."""
    mesh = config.mesh
    seed = config.determinism.seed
    if mesh.pipeline_parallel == 1:
        return [_Stage(PipelineStageInfo(), RankSeeds.for_rank(mesh, 0, seed).parameters)]
    placement = config.schedule.placement(mesh.pipeline_parallel)
    regular = compute_layout(mesh, MeshDomain.REGULAR)
    rank_of_pp = {pp: int(regular.ranks[pp].min()) for pp in range(mesh.pipeline_parallel)}
    n = len(placement.stage_ranks)
    return [
        _Stage(
            PipelineStageInfo(s, n),
            # the position of stage s among its rank's stages, as training built them (`local_stages`)
            stage_seed(
                RankSeeds.for_rank(mesh, rank_of_pp[pp], seed).parameters, placement.stages_of(pp).index(s), s
            ),
        )
        for s, pp in enumerate(placement.stage_ranks)
    ]


def _model_state(module: nn.Module, trainable_only: bool) -> dict[str, Any]:
    state = get_model_state_dict(module)
    return trainable_state_dict(module, state) if trainable_only else state


def load_model(config: TrainConfig, step_dir: Location) -> tuple[ModelProvider, list[nn.Module]]:
    """All stages of the model, built like training built them, holding the step's weights (on CPU).
    The step is verified first; non-tensor items load weights-only (`SafeLoadPlanner`), as on resume."""
    verify_step(step_dir)
    ctx = DistributedContext.local()
    provider = build_model(config.model)
    modules = [
        build_stages(
            provider,
            [stage.info],
            ctx,
            parameter_seed=stage.seed,
            compile_config=CompileConfig(enabled=False),
            training=False,
        ).modules[0]
        for stage in _stages(config)
    ]
    trainable_only = config.checkpointing.trainable_only
    states = [_model_state(m, trainable_only) for m in modules]
    merged = {k: v for state in states for k, v in state.items()}
    try:
        with warnings.catch_warnings():
            # One process reading on purpose; DCP warns that it assumes so.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(
                {"app": {"model": merged}},
                checkpoint_id=str(step_dir),
                storage_reader=safe_reader(step_dir),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"cannot load the model of {step_dir}: {dcp_problem(e)}") from None
    options = StateDictOptions(strict=not trainable_only)
    for module, state in zip(modules, states, strict=True):
        set_model_state_dict(module, {k: merged[k] for k in state}, options=options)
    return provider, modules


class InexactExportError(ValueError):
    """The target format cannot hold the model exactly; the message says what and which options remain."""


def refuse_inexact(provider: ModelProvider, flag: str) -> None:
    """Raise `InexactExportError` when the export would differ from the model, naming the options."""
    gap = export_gap(provider)
    if gap is not None:
        raise InexactExportError(
            f"refusing to export: {gap}. Options: {flag} to export anyway (d9d export measures how much "
            "the logits differ on a probe batch); train with expert_bias: false; or keep the model in d9d's "
            "own checkpoints (d9d reloads expert_bias exactly)"
        )


@dataclass(frozen=True)
class LogitsComparison:
    """How far `got` logits are from `reference` logits on a probe batch."""

    tokens: int
    max_abs: float
    max_rel: float  # max |got - reference| / max |reference|
    argmax_agreement: float  # fraction of tokens whose top-1 prediction is the same

    #: Relative difference below which two float32 computations of one model count as the same.
    TOLERANCE = 1e-3

    @property
    def exact(self) -> bool:
        return self.max_rel <= self.TOLERANCE

    def describe(self) -> str:
        return (
            f"max |logit difference| {self.max_abs:.3g} (relative {self.max_rel:.3g}), argmax agrees on "
            f"{self.argmax_agreement:.0%} of {self.tokens} probe tokens"
        )


def compare_logits(reference: torch.Tensor, got: torch.Tensor) -> LogitsComparison:
    reference, got = reference.double(), got.double()
    diff = float((got - reference).abs().max())
    scale = float(reference.abs().max()) or 1.0
    agree = float((got.argmax(-1) == reference.argmax(-1)).double().mean())
    return LogitsComparison(reference.shape[:-1].numel(), diff, diff / scale, agree)


def probe_ids(vocab_size: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    """A fixed probe batch of token ids."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))


def d9d_logits(
    modules: Sequence[nn.Module], ids: torch.Tensor, *, without_expert_bias: bool = False
) -> torch.Tensor:
    """The model's float32 logits on `ids`, the stages run in order on this process (`without_expert_bias`:
    as a format without the routing bias computes them)."""
    for module in modules:
        module.float()
    routers = [m for module in modules for m in module.modules() if isinstance(m, TopKRouter)]
    saved = [r.expert_bias.clone() if r.expert_bias is not None else None for r in routers]
    try:
        if without_expert_bias:
            for r in routers:
                if r.expert_bias is not None:
                    r.expert_bias.zero_()
        with torch.no_grad():
            out: dict[str, torch.Tensor] = {}
            for i, module in enumerate(modules):
                out = module(**({"input_ids": ids} if i == 0 else {"hidden_states": out["hidden_states"]}))
            return out["logits"].float()
    finally:
        for r, bias in zip(routers, saved, strict=True):
            if bias is not None and r.expert_bias is not None:
                r.expert_bias.copy_(bias)


def transformers_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """The exported model's float32 logits on `ids`, as `transformers` computes them."""
    try:
        import transformers
    except ImportError:
        raise ValueError("export --check runs the export in transformers, which is not installed") from None
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=ids).logits
    return logits.float()


@dataclass(frozen=True)
class ExportReport:
    dest: Path
    gap: str | None = None  # what the format could not hold (exported anyway with `inexact`)
    drift: LogitsComparison | None = None  # d9d's logits vs d9d's without what the format cannot hold
    check: LogitsComparison | None = None  # the exported model in transformers vs what d9d promised


def export_checkpoint(
    config: TrainConfig,
    step_dir: Location,
    dest: Path,
    kind: ExportKind,
    *,
    base_model_name_or_path: str | None = None,
    inexact: bool = False,
    check: bool = False,
) -> ExportReport:
    """Write `dest` from the committed `step_dir`: merged Hugging Face weights, or a `peft` adapter.

    An export the format cannot hold exactly is refused (`InexactExportError`) unless `inexact`; then the
    logit difference it causes is measured on a probe batch (`ExportReport.drift`). `check` loads a merged
    export in transformers and compares its logits with d9d's (`ExportReport.check`)."""
    provider = build_model(config.model)
    gap = export_gap(provider)
    if not inexact:
        refuse_inexact(provider, "--inexact")
    if check and kind != "merged":
        raise ValueError("export --check compares a merged export's logits; it does not apply to --adapter")
    if check:
        _vocab_size(provider)  # a causal LM of the built-in providers, or refused before any loading
    provider, modules = load_model(config, step_dir)
    ctx = DistributedContext.local()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="expert_bias")  # refused above, or accepted by `inexact`
        _export(provider, modules, ctx, dest, kind, base_model_name_or_path)
    drift = comparison = None
    if gap is not None or check:
        ids = probe_ids(_vocab_size(provider))
        reference = d9d_logits(modules, ids)
        promised = d9d_logits(modules, ids, without_expert_bias=True) if gap is not None else reference
        if gap is not None:
            drift = compare_logits(reference, promised)
        if check:
            comparison = compare_logits(promised, transformers_logits(dest, ids))
    return ExportReport(dest, gap, drift, comparison)


def _vocab_size(provider: ModelProvider) -> int:
    base = provider.base if isinstance(provider, PeftModelProvider) else provider
    if not isinstance(base, CausalLMProvider):
        raise ValueError("a logit probe needs a causal LM of a built-in model family's provider")
    return int(base.model_config.vocab_size)


def _export(
    provider: ModelProvider,
    modules: Sequence[nn.Module],
    ctx: DistributedContext,
    dest: Path,
    kind: ExportKind,
    base_model_name_or_path: str | None,
) -> None:
    match kind, provider:
        case "merged", PeftModelProvider():
            provider.export_merged(modules, ctx, dest)
        case "merged", _:
            provider.export(modules, ctx, dest)
        case "adapter", PeftModelProvider():
            provider.export_adapter(modules, ctx, dest, base_model_name_or_path)
        case "adapter", _:
            raise ValueError(
                f"an adapter export needs a model with PEFT adapters (model.provider: peft), not "
                f"{type(provider).__name__}; export merged weights instead"
            )
