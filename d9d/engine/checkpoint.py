"""Checkpoints of a whole training state, with an atomic commit.

Layout under the checkpoint root:

    step-00000010/        # one directory per saved step
      .metadata, __<rank>_<i>.distcp   # torch.distributed.checkpoint: model + optimizer, DTensor-aware
      engine.pt            # rank 0: step, LR schedulers, data position, task/metric/tracker state
      train_config.json    # rank 0: the job config that wrote the step (what `d9d export` rebuilds)
      rank-00003.pt        # per rank: RNG states
      manifest.json        # written last, by the committer: files, sizes, sha256
    latest                # name of the last committed step directory (replaced atomically)

A step is resumable only once `latest` names it, and `latest` moves only after every rank reported its
files. A crash in the middle of a save therefore leaves the previous step as latest; the half-written
directory is removed when that step is saved again.

Model and optimizer state go through DCP with flattened optimizer keys (`state.<fqn>.exp_avg`), so
pipeline stages on different ranks never collide and loading with a different data-parallel degree
reshards DTensors automatically.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from d9d.core.context import DistributedContext
from d9d.core.dist_ops import gather_object
from d9d.core.files import atomic_write_text
from d9d.engine.runtime import CheckpointFile, RankCheckpointReport, RunReporter
from d9d.peft import trainable_state_dict

MANIFEST = "manifest.json"
LATEST = "latest"
ENGINE_STATE = "engine.pt"
TRAIN_CONFIG = "train_config.json"
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    pass


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_state_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_latest(root: Path) -> Path | None:
    """The committed step directory named by `latest`, or None when nothing was committed."""
    pointer = root / LATEST
    if not pointer.exists():
        return None
    step_dir = root / pointer.read_text().strip()
    if not (step_dir / MANIFEST).is_file():
        raise CheckpointError(
            f"{pointer} names {step_dir}, which has no {MANIFEST}: the checkpoint is damaged"
        )
    return step_dir


def is_committed(step_dir: Path) -> bool:
    return (step_dir / MANIFEST).is_file()


def commit(root: Path, step: int, reports: Sequence[RankCheckpointReport], keep_last: int) -> Path:
    """Verify every rank's files, write the manifest, move `latest`, prune old steps."""
    step_dir = root / step_dir_name(step)
    files: dict[str, dict[str, Any]] = {}
    for report in sorted(reports, key=lambda r: r.rank):
        for f in report.files:
            path = step_dir / f.relative_path
            if not path.is_file() or path.stat().st_size != f.size_bytes:
                raise CheckpointError(f"rank {report.rank}: {path} is missing or not {f.size_bytes} bytes")
            files[f.relative_path] = {"rank": report.rank, "size": f.size_bytes, "sha256": f.sha256}
    manifest = {"step": step, "ranks": sorted(r.rank for r in reports), "files": files}
    atomic_write_text(step_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    atomic_write_text(root / LATEST, step_dir.name)
    prune(root, keep_last)
    return step_dir


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` committed steps; drop older committed and uncommitted step dirs."""
    latest = read_latest(root)
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    committed = [p for p in steps if is_committed(p)]
    keep = set(committed[-keep_last:])
    for p in steps:
        if p in keep or p == latest:
            continue
        if is_committed(p) or (latest is not None and p.name < latest.name):
            shutil.rmtree(p, ignore_errors=True)


def verify_manifest(step_dir: Path) -> None:
    """Check every file of a committed step against its manifest (size and sha256)."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    for rel, info in manifest["files"].items():
        path = step_dir / rel
        if not path.is_file() or path.stat().st_size != info["size"] or sha256_of(path) != info["sha256"]:
            raise CheckpointError(f"{path} does not match the manifest of {step_dir}")


def _dcp_problem(error: BaseException) -> str:
    """The informative line of a DCP load failure (it nests every rank's traceback), keys made readable."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.startswith(("ValueError", "RuntimeError", "KeyError")) or "mismatch" in line.lower():
            return (
                line.split(": ", 1)[-1]
                .replace("app.model.", "model key ")
                .replace("app.optim.", "optimizer key ")
            )
    return lines[-1] if lines else repr(error)


StageOptimizers = Sequence[tuple[nn.Module, torch.optim.Optimizer]]
"""Each local stage with its optimizer (`PipelinedOptimizer.pair_with`, which checks they match)."""


class _ModelAndOptimizerState(Stateful):
    """DCP view of all local stages: merged FQN-keyed model state and flattened optimizer state."""

    def __init__(self, stages: StageOptimizers, trainable_only: bool = False) -> None:
        self.stages = stages
        self.trainable_only = trainable_only

    def _model_state(self, module: nn.Module) -> dict[str, Any]:
        state = get_model_state_dict(module)
        return trainable_state_dict(module, state) if self.trainable_only else state

    def state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for module, optimizer in self.stages:
            model.update(self._model_state(module))
            optim.update(get_optimizer_state_dict(module, optimizer, options=_OPTIM_OPTIONS))
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        model, optim = state_dict["model"], state_dict["optim"]
        for module, optimizer in self.stages:
            own_model = {k: model[k] for k in self._model_state(module)}
            set_model_state_dict(module, own_model, options=StateDictOptions(strict=not self.trainable_only))
            own_optim = {
                k: optim[k] for k in get_optimizer_state_dict(module, optimizer, options=_OPTIM_OPTIONS)
            }
            set_optimizer_state_dict(module, optimizer, own_optim, options=_OPTIM_OPTIONS)


class Checkpointer:
    """Saves and restores the engine's state through a `RunReporter` commit protocol."""

    def __init__(
        self,
        ctx: DistributedContext,
        root: Path,
        reporter: RunReporter,
        trainable_only: bool = False,
        train_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.ctx = ctx
        self.root = root
        self.reporter = reporter
        self.trainable_only = trainable_only
        self.train_config = train_config

    def save(
        self,
        step: int,
        stages: StageOptimizers,
        engine_state: Mapping[str, Any],
        rank_state: Mapping[str, Any],
    ) -> Path:
        step_dir = self.root / step_dir_name(step)
        if self.ctx.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            if step_dir.exists() and not is_committed(step_dir):
                shutil.rmtree(step_dir)  # leftovers of an interrupted save of the same step
        self.ctx.barrier()
        dcp_save(
            {"app": _ModelAndOptimizerState(stages, self.trainable_only)},
            checkpoint_id=str(step_dir),
        )
        rank = self.ctx.rank
        torch.save(dict(rank_state), step_dir / rank_state_name(rank))
        names = [p.name for p in step_dir.glob(f"__{rank}_*.distcp")] + [rank_state_name(rank)]
        if self.ctx.is_main_process:
            torch.save(dict(engine_state), step_dir / ENGINE_STATE)
            names += [".metadata", ENGINE_STATE]
            if self.train_config is not None:
                (step_dir / TRAIN_CONFIG).write_text(json.dumps(self.train_config, indent=1) + "\n")
                names.append(TRAIN_CONFIG)
        report = RankCheckpointReport(
            step=step,
            rank=rank,
            step_dir=step_dir,
            files=tuple(
                CheckpointFile(n, (step_dir / n).stat().st_size, sha256_of(step_dir / n))
                for n in sorted(names)
            ),
        )
        self.reporter.checkpoint_written(report)
        reports = gather_object(report, dst=0) if self.ctx.is_distributed else [report]
        if self.ctx.is_main_process:
            assert reports is not None
            self.reporter.commit_checkpoint(step, reports)
        self.ctx.barrier()
        return step_dir

    def latest(self) -> Path | None:
        return self.reporter.latest_checkpoint()

    def load(
        self,
        step_dir: Path,
        stages: StageOptimizers,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Restore model + optimizer in place; return (engine state, this rank's state or None).

        The rank state is None when the checkpoint came from a different world size (elastic restart):
        RNG streams cannot be mapped onto a new set of ranks, the rest of the state can.
        """
        try:
            dcp_load(
                {"app": _ModelAndOptimizerState(stages, self.trainable_only)},
                checkpoint_id=str(step_dir),
            )
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"cannot load {step_dir} into this model: {_dcp_problem(e)}") from e
        engine_state: dict[str, Any] = torch.load(step_dir / ENGINE_STATE, weights_only=True)
        rank_file = step_dir / rank_state_name(self.ctx.rank)
        same_world = engine_state.get("world_size") == self.ctx.world_size
        rank_state = torch.load(rank_file, weights_only=True) if same_world and rank_file.exists() else None
        return engine_state, rank_state


class LocalRunReporter:
    """Reporter for launchers without a coordinator (single process, torchrun): the filesystem commits."""

    def __init__(self, checkpoint_root: Path, keep_last: int, metrics_sink: Any | None = None) -> None:
        self.root = checkpoint_root
        self.keep_last = keep_last
        self.metrics_sink = metrics_sink

    def metrics(self, point: Any) -> None:
        if self.metrics_sink is not None:
            self.metrics_sink(point)

    def commands(self, step: int) -> list[Any]:
        return []

    def checkpoint_written(self, report: RankCheckpointReport) -> None:
        return None

    def commit_checkpoint(self, step: int, reports: Sequence[RankCheckpointReport]) -> None:
        commit(self.root, step, reports, self.keep_last)

    def latest_checkpoint(self) -> Path | None:
        return read_latest(self.root)
