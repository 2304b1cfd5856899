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

from dataclasses import dataclass
from typing import Literal

from d9d.core.storage import Location
from d9d.engine.checkpoint import (
    CheckpointError,
    committed_steps,
    read_manifest,
    require_listed,
    select_commit,
    verify_manifest,
)
from d9d.engine.config import TrainConfig
from d9d.engine.identity import IDENTITY_FILE, check_identity


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
    checkpoint it picks; writes nothing."""
    selection = select_commit(config.checkpoint_dir, config.checkpointing.on_damaged)
    return decide_resume(config, selection.step_dir, new_launch=True, warnings=selection.warnings)


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
