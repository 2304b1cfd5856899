"""Whether and from where a run continues: one decision, taken on the driver before anything starts and
again by the engine when it resumes (torchrun launches have no driver; a restarted attempt re-decides).

    decision = check_resume(config)        # raises ResumeError / IdentityError with the reason
    decision.action                        # "fresh" | "resume" | "finished"

Rules (docs/engine.md, "Resume semantics and checkpoint trust model"):
- the run's own newest verified commit wins (`select_commit`: `latest` is a hint, damaged commits are
  skipped or fatal per `checkpointing.on_damaged`);
- `run.resume`: `auto` continues when a commit exists; `never` refuses to start over committed work;
  `required` refuses to start without one;
- `run.resume_from` (`--resume-from`) seeds a run whose own directory holds no commit yet; given while the
  run has commits of its own, a launch is refused (continue without it, or branch into a new run dir);
  a restarted attempt of the same launch continues from its own commits;
- the commit resumed from must carry the same run identity (`d9d.engine.identity`);
- a commit at or past `trainer.total_steps` means the run is finished: nothing is trained or written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from d9d.core.mesh_params import DeviceMeshParameters
from d9d.core.storage import Location
from d9d.engine.checkpoint import (
    ENGINE_STATE,
    TRAIN_CONFIG,
    CheckpointError,
    committed_steps,
    read_manifest,
    require_listed,
    select_commit,
    verify_manifest,
)
from d9d.engine.checkpoint_io import load_state_file
from d9d.engine.components import build_data
from d9d.engine.config import TrainConfig
from d9d.engine.identity import IDENTITY_FILE, check_identity
from d9d.engine.providers import DataSetup
from d9d.pipeline.optim import PipelinedLRScheduler, PipelinedOptimizer


class ResumeError(CheckpointError):
    """The run cannot start as configured; the message says why and what to change."""


@dataclass(frozen=True)
class ResumeDecision:
    action: Literal["fresh", "resume", "finished"]
    step_dir: Location | None  # the verified commit to continue from
    step: int  # its step (0 when fresh)
    source: Literal["none", "own", "resume_from"]
    warnings: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        match self.action:
            case "fresh":
                return "starting from scratch (no committed checkpoint)"
            case "resume":
                return f"resuming from {self.step_dir} (step {self.step})"
            case "finished":
                return (
                    f"already finished: the newest commit {self.step_dir} is at step {self.step}; nothing "
                    "to do (raise trainer.total_steps to train further)"
                )


def check_resume(config: TrainConfig) -> ResumeDecision:
    """The driver's decision for a new launch of `config`, from what is on disk. Reads and hashes the
    checkpoint it picks; writes nothing. A resume whose data layout changed is checked here too
    (`check_data_layout`), before any process group or actor exists."""
    selection = select_commit(config.checkpoint_dir, config.checkpointing.on_damaged)
    decision = decide_resume(config, selection.step_dir, new_launch=True, warnings=selection.warnings)
    if decision.action == "resume" and decision.step_dir is not None:
        check_data_layout(config, decision.step_dir)
    return decision


def committed_config(step_dir: Location) -> dict[str, Any] | None:
    """The job config that wrote a commit (`train_config.json`, JSON, listed in the manifest), or None for
    a commit from before it was saved."""
    path = step_dir / TRAIN_CONFIG
    if not path.is_file():
        return None
    require_listed(step_dir, [TRAIN_CONFIG])
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON: {e}") from None
    return data if isinstance(data, dict) else None


def _layout(batching: Mapping[str, Any], mesh: Mapping[str, Any]) -> tuple[int, int]:
    return int(batching["microbatch_size"]), DeviceMeshParameters.model_validate(mesh).data_parallel


def check_data_layout(config: TrainConfig, step_dir: Location) -> None:
    """Microbatch size and data-parallel degree may change on resume only where the data provider continues
    its saved position exactly: when they differ from the commit's, the provider is set up with the new
    layout (data-parallel rank 0) and given the commit's data state; a provider that cannot continue it
    (e.g. the text provider's bucketing packs batches of `microbatch_size`) refuses, and so does the launch,
    before any actor starts."""
    old = committed_config(step_dir)
    if old is None:
        return
    try:
        before = _layout(old["batching"], old.get("mesh", {}))
    except (KeyError, TypeError, ValueError):
        return  # a config the commit holds in another shape: the engine's own load decides
    batching, mesh = config.batching, config.mesh
    after = (batching.microbatch_size, mesh.data_parallel)
    if before == after:
        return
    change = "; ".join(
        f"{name} {a} -> {b}"
        for name, a, b in zip(("batching.microbatch_size", "data parallel"), before, after, strict=True)
        if a != b
    )
    require_listed(step_dir, [ENGINE_STATE])
    state = load_state_file(step_dir / ENGINE_STATE)
    if not isinstance(state, dict) or "data" not in state:
        return
    provider = build_data(config.data)
    try:
        provider.setup(
            DataSetup(
                dp_rank=0,
                dp_size=mesh.data_parallel,
                microbatch_size=batching.microbatch_size,
                gradient_accumulation=batching.gradient_accumulation(mesh.data_parallel),
                global_batch_size=batching.global_batch_size,
                seed=config.determinism.seed,
            )
        )
        provider.load_state_dict(state["data"])
    except (ValueError, KeyError, TypeError) as e:
        raise ResumeError(
            f"{step_dir}: the data provider cannot continue the commit's data position after {change}: {e}. "
            "Resume with the commit's layout, or start a new run (another run.name or run.dir; "
            "--resume-from keeps the weights)"
        ) from None


def decide_resume(
    config: TrainConfig,
    own: Location | None,
    *,
    new_launch: bool,
    warnings: tuple[str, ...] = (),
) -> ResumeDecision:
    """The decision given the run's own newest verified commit `own` (None: it has none).

    `new_launch` is False for a restarted attempt of a launch already decided (its own commits are its
    progress, whatever `run.resume` and `run.resume_from` say)."""
    run = config.run
    root = config.checkpoint_dir
    source: Literal["own", "resume_from"]
    if own is not None:
        if new_launch and run.resume == "never":
            raise ResumeError(
                f"run.resume=never, but {root} holds committed work (newest: {own.name}); it is never "
                "overwritten: pick a new run.name or run.dir, or set run.resume=auto to continue it"
            )
        if run.resume_from is not None and run.resume_from.resolve() != own.resolve() and new_launch:
            raise ResumeError(
                f"--resume-from {run.resume_from} was given, but {root} already holds commits of its own "
                f"(newest: {own.name}); drop --resume-from to continue this run, or pick a new run.name or "
                "run.dir to start a new run from that step"
            )
        step_dir, source = own, "own"
    elif run.resume_from is not None:
        if run.resume == "never":
            raise ResumeError("run.resume=never contradicts --resume-from (run.resume_from)")
        step_dir, source = run.resume_from, "resume_from"
        if not step_dir.is_dir() or not (step_dir / "manifest.json").is_file():
            hint = ""
            if step_dir.is_dir() and committed_steps(step_dir):
                hint = f" (it holds commits: give one of them, e.g. {committed_steps(step_dir)[-1]})"
            raise ResumeError(f"--resume-from {step_dir} is not a committed step directory{hint}")
        try:
            verify_manifest(step_dir)
        except CheckpointError as e:
            raise ResumeError(f"--resume-from {step_dir} is damaged: {e}") from None
    else:
        if run.resume == "required":
            raise ResumeError(
                f"run.resume=required, but {root} holds no committed checkpoint (and no --resume-from "
                "was given)"
            )
        return ResumeDecision("fresh", None, 0, "none", warnings)
    if (step_dir / IDENTITY_FILE).is_file():
        require_listed(step_dir, [IDENTITY_FILE])
    check_identity(step_dir, config)
    step = int(read_manifest(step_dir)["step"])
    action: Literal["resume", "finished"] = "finished" if step >= config.trainer.total_steps else "resume"
    return ResumeDecision(action, step_dir, step, source, warnings)


# -- what a new launch changes when it resumes (docs/engine.md, "What may change on resume") ---------------


def base_lrs(optimizer: PipelinedOptimizer, schedulers: PipelinedLRScheduler | None) -> list[float]:
    """Every param group's base LR: its scheduler's base, or its LR without a scheduler."""
    if schedulers is not None:
        return [float(lr) for s in schedulers.schedulers.values() for lr in s.base_lrs]
    return [float(g["lr"]) for o in optimizer.optimizers.values() for g in o.param_groups]


def set_base_lrs(
    optimizer: PipelinedOptimizer, schedulers: PipelinedLRScheduler | None, bases: list[float]
) -> None:
    """Make `bases` the groups' base LRs, keeping the schedule's position (the LR scales with it)."""
    if schedulers is None:
        groups = [g for o in optimizer.optimizers.values() for g in o.param_groups]
        for group, base in zip(groups, bases, strict=True):
            group["lr"] = base
        return
    slots = [
        (s.base_lrs, i, g)
        for s in schedulers.schedulers.values()
        for i, g in enumerate(s.optimizer.param_groups)
    ]
    for (scheduled, i, group), base in zip(slots, bases, strict=True):
        if scheduled[i] == base:
            continue
        group["lr"] = group["lr"] * (base / scheduled[i]) if scheduled[i] else base
        scheduled[i] = base
        if "initial_lr" in group:
            group["initial_lr"] = base


def resume_changes(
    config: TrainConfig,
    committed: Mapping[str, Any],
    committed_lrs: list[float],
    configured_lrs: list[float],
    step: int,
) -> list[str]:
    """What this launch's config changes in the optimization against the commit's (`committed`, its
    train_config): the notes a resume announces, empty when it continues as the commit would have."""
    notes = []
    if committed_lrs != configured_lrs:
        notes.append(
            f"base LR {_lrs(committed_lrs)} -> {_lrs(configured_lrs)} (optimizer.options.lr): the new base "
            f"LR applies from step {step + 1}"
        )
    old_total = committed.get("trainer", {}).get("total_steps")
    if old_total is not None and old_total != config.trainer.total_steps:
        notes.append(
            f"trainer.total_steps {old_total} -> {config.trainer.total_steps}: the LR schedule is re-planned "
            f"for {config.trainer.total_steps} steps from step {step + 1} (phases given in steps keep their "
            "length; percentages and the rest phase are recomputed)"
        )
    new_schedule = config.model_dump(mode="json", by_alias=True).get("lr_scheduler")
    if "lr_scheduler" in committed and committed.get("lr_scheduler") != new_schedule:
        notes.append(f"lr_scheduler changed: the new schedule applies from step {step + 1}")
    return notes


def _lrs(values: list[float]) -> str:
    distinct = sorted(set(values))
    return f"{distinct[0]:.3g}" if len(distinct) == 1 else "[" + ", ".join(f"{v:.3g}" for v in values) + "]"
