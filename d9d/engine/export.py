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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain, compute_layout
from d9d.core.storage import AnyLocation, Location, StoragePath, copy_tree
from d9d.determinism import RankSeeds
from d9d.engine.builtin.peft import PeftModelProvider
from d9d.engine.checkpoint import (
    LATEST,
    TRAIN_CONFIG,
    CheckpointError,
    is_committed,
    read_latest,
    step_dir_name,
)
from d9d.engine.checkpoint_io import safe_reader
from d9d.engine.config import ConfigError, TrainConfig, parse_config
from d9d.engine.providers import ModelProvider
from d9d.engine.registry import build_model
from d9d.engine.stages import build_stages
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
    """The committed step directory of `run` (a run directory or a checkpoint root): `step`, else latest."""
    match run:  # one call per kind: a Path's steps are Paths, a StoragePath's are StoragePaths
        case Path():
            return _find_step(run, step)
        case StoragePath():
            return _find_step(run, step)


def _find_step(run: AnyLocation, step: int | None) -> AnyLocation:
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


def read_train_config(step_dir: Location) -> TrainConfig:
    """The job config saved with the step (checks plug-ins, so their classes must be importable here)."""
    path = step_dir / TRAIN_CONFIG
    if not path.is_file():
        raise ConfigError(
            f"{step_dir} has no {TRAIN_CONFIG} (written by d9d since the export command exists); "
            "pass the job file that trained it with --config"
        )
    data: dict[str, Any] = json.loads(path.read_text())
    return parse_config(data)


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
        _Stage(PipelineStageInfo(s, n), RankSeeds.for_rank(mesh, rank_of_pp[pp], seed).parameters)
        for s, pp in enumerate(placement.stage_ranks)
    ]


def _model_state(module: nn.Module, trainable_only: bool) -> dict[str, Any]:
    state = get_model_state_dict(module)
    return trainable_state_dict(module, state) if trainable_only else state


def load_model(config: TrainConfig, step_dir: Location) -> tuple[ModelProvider, list[nn.Module]]:
    """All stages of the model, built like training built them, holding the step's weights (on CPU)."""
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
                no_dist=True,
            )
    except Exception as e:
        raise CheckpointError(f"cannot load the model of {step_dir}: {e}") from e
    options = StateDictOptions(strict=not trainable_only)
    for module, state in zip(modules, states, strict=True):
        set_model_state_dict(module, {k: merged[k] for k in state}, options=options)
    return provider, modules


def export_checkpoint(
    config: TrainConfig,
    step_dir: Location,
    dest: Path,
    kind: ExportKind,
    *,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write `dest` from the committed `step_dir`: merged Hugging Face weights, or a `peft` adapter."""
    provider, modules = load_model(config, step_dir)
    ctx = DistributedContext.local()
    with torch.no_grad():
        _export(provider, modules, ctx, dest, kind, base_model_name_or_path)
    return dest


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
