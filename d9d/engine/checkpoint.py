"""Checkpoints of a whole training state, with an atomic commit.

Layout under the checkpoint root:

    step-00000010/        # one directory per saved step
      .metadata, __<rank>_<i>.distcp   # torch.distributed.checkpoint: model + optimizer, DTensor-aware
      engine.pt            # rank 0: step, LR schedulers, data position, task/metric/tracker state
      train_config.json    # rank 0: the job config that wrote the step (what `d9d export` rebuilds)
      rank-00003.pt        # per rank: RNG states
      identity.json        # rank 0: the run identity (`d9d.engine.identity`)
      manifest.json        # written last, by the committer: files, sizes, sha256
    latest                # name of the last committed step directory (replaced atomically)
    damaged/              # damaged commits moved out of the way (never deleted, never written into)

The root is a `d9d.core.storage.Location`: a local directory, or an object store URI (`run.storage`), where
every file is one PUT and there is no rename; the order below (files, then the manifest, then `latest`) is
the whole commit protocol there.

A step is committed once its manifest exists, and the manifest is written only after every rank reported
its files. A crash in the middle of a save therefore leaves the previous commit as the newest; the
half-written directory is removed when that step is saved again.

The trust model (docs/engine.md, "Resume semantics and checkpoint trust model"):
- a committed step directory is never written again: `Checkpointer.save` refuses one that verifies and
  moves a damaged one to `damaged/` before writing the step afresh;
- the commit to resume from is the newest one whose files match its manifest (`select_commit`); `latest`
  is only a hint, and a missing, unreadable or stale `latest`, or damaged newer commits, are reported by
  name; with commits present but none verifying nothing starts;
- every byte is hashed as it is written (`d9d.engine.checkpoint_io.HashingWriter`), so a save reads
  nothing back; files are verified against the manifest before a resume loads them;
- nothing in a checkpoint is unpickled beyond plain data and the DCP metadata types.

Model and optimizer state go through DCP with flattened optimizer keys (`state.<fqn>.exp_avg`), so
pipeline stages on different ranks never collide and loading with a different data-parallel degree
reshards DTensors automatically.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed import ProcessGroup
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
from d9d.core.dist_ops import all_gather_object, gather_object
from d9d.core.storage import AnyLocation, Location, move_tree, remove_tree, write_file, write_text
from d9d.engine.checkpoint_io import (
    METADATA,
    SafeLoadPlanner,
    WrittenFile,
    hashed_bytes,
    hashing_writer,
    load_state_file,
    read_dcp_metadata,
    safe_reader,
)
from d9d.engine.checkpoint_io import CheckpointError as CheckpointError  # re-exported: the engine's error
from d9d.engine.checkpoint_io import UnsafeCheckpointError as UnsafeCheckpointError
from d9d.engine.identity import IDENTITY_FILE, RunIdentity
from d9d.engine.runtime import CheckpointFile, RankCheckpointReport, RunReporter
from d9d.peft import trainable_state_dict

MANIFEST = "manifest.json"
LATEST = "latest"
ENGINE_STATE = "engine.pt"
DAMAGED = "damaged"
TRAIN_CONFIG = "train_config.json"
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
OnDamaged = Literal["fallback", "fail"]

_log = logging.getLogger(__name__)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_state_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def sha256_of(path: Location) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_latest(root: AnyLocation) -> AnyLocation | None:
    """The committed step directory named by `latest`, or None when there is no `latest`."""
    pointer = root / LATEST
    if not pointer.exists():
        return None
    step_dir = root / pointer.read_text().strip()
    if not (step_dir / MANIFEST).is_file():
        raise CheckpointError(
            f"{pointer} names {step_dir}, which has no {MANIFEST}: the checkpoint is damaged"
        )
    return step_dir


def is_committed(step_dir: Location) -> bool:
    return (step_dir / MANIFEST).is_file()


def committed_steps(root: Location) -> list[Location]:
    """Step directories with a manifest, oldest first."""
    return sorted(p for p in root.glob("step-*") if p.is_dir() and is_committed(p))


def commit(root: Location, step: int, reports: Sequence[RankCheckpointReport], keep_last: int) -> Location:
    """Check every rank's files are there at their reported sizes, write the manifest, move `latest`,
    prune old steps. The hashes are the ones the ranks computed while writing: nothing is read back."""
    step_dir = root / step_dir_name(step)
    files: dict[str, dict[str, Any]] = {}
    for report in sorted(reports, key=lambda r: r.rank):
        for f in report.files:
            path = step_dir / f.relative_path
            if not path.is_file() or path.stat().st_size != f.size_bytes:
                raise CheckpointError(f"rank {report.rank}: {path} is missing or not {f.size_bytes} bytes")
            files[f.relative_path] = {"rank": report.rank, "size": f.size_bytes, "sha256": f.sha256}
    manifest = {"step": step, "ranks": sorted(r.rank for r in reports), "files": files}
    # Written last, in this order: on an object store (no rename) these two writes are the commit.
    write_text(step_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    write_text(root / LATEST, step_dir.name)
    # The committer checked every file against the hash its writer computed; choosing this step again in
    # this process (a restart's resume decision) would only hash the same unchanged bytes once more.
    with contextlib.suppress(OSError):
        _verified[step_dir] = _stat_key(step_dir, sorted(files))
    prune(root, keep_last)
    return step_dir


def prune(root: Location, keep_last: int) -> None:
    """Keep the newest `keep_last` committed steps; drop older committed and uncommitted step dirs."""
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    committed = [p for p in steps if is_committed(p)]
    keep = set(committed[-keep_last:])
    newest = committed[-1] if committed else None
    for p in steps:
        if p in keep:
            continue
        if is_committed(p) or (newest is not None and p.name < newest.name):
            remove_tree(p)


# -- verification ------------------------------------------------------------------------------------------

# Directories verified (or committed) by this process, keyed by the stat of the manifest and of every file
# it lists: a rank that verified a commit while choosing it does not hash it again when it loads it, and a
# coordinator does not hash the step it committed itself when a restart resumes from it.
_verified: dict[Location, tuple[tuple[str, int, int], ...]] = {}


def _stat_key(step_dir: Location, names: Sequence[str]) -> tuple[tuple[str, int, int], ...]:
    key = []
    for name in (MANIFEST, *names):
        st = (step_dir / name).stat()
        key.append((name, st.st_size, st.st_mtime_ns))
    return tuple(key)


def read_manifest(step_dir: Location) -> dict[str, Any]:
    path = step_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        int(manifest["step"])
        if not isinstance(files, dict) or not files:
            raise ValueError("it lists no files")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not a readable manifest: {e}") from None
    result: dict[str, Any] = manifest
    return result


def verify_manifest(step_dir: Location) -> dict[str, Any]:
    """Check every file of a committed step against its manifest (size, then sha256); return the manifest.

    Costs one sequential read and hash of the step directory, once per process: ~1.7 s per GiB measured
    on the CI machine (sha256 at ~600 MiB/s on one core of a shared 2-core AMD EPYC; docs/engine.md).
    """
    manifest = read_manifest(step_dir)
    files: dict[str, Any] = manifest["files"]
    try:
        key = _stat_key(step_dir, sorted(files))
    except OSError:
        key = None
    if key is not None and _verified.get(step_dir) == key:
        return manifest
    for rel, info in sorted(files.items()):
        path = step_dir / rel
        if Path(rel).name != rel:
            raise CheckpointError(f"{step_dir / MANIFEST} lists {rel!r}, outside its directory")
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (listed in {step_dir / MANIFEST})")
        size = path.stat().st_size
        if size != info["size"]:
            raise CheckpointError(f"{path} is {size} bytes, its manifest says {info['size']}")
        if sha256_of(path) != info["sha256"]:
            raise CheckpointError(f"{path} does not match the sha256 in its manifest")
    if key is not None:
        _verified[step_dir] = key
    return manifest


def require_listed(
    step_dir: Location, names: Iterable[str], manifest: Mapping[str, Any] | None = None
) -> None:
    """Refuse to read files of a commit that its manifest does not cover (nothing vouches for them: an
    unlisted file is never verified, whatever its content)."""
    listed = (manifest if manifest is not None else read_manifest(step_dir))["files"]
    missing = sorted(set(names) - set(listed))
    if missing:
        raise CheckpointError(
            f"{step_dir / MANIFEST} does not list {', '.join(missing)}, which loading this step reads; "
            "refusing to load files the manifest does not cover"
        )


def dcp_files(step_dir: Location, manifest: Mapping[str, Any] | None = None) -> set[str]:
    """`.metadata` and every data file it points at, each checked to be listed in the manifest (the
    metadata itself is checked before it is read)."""
    manifest = manifest if manifest is not None else read_manifest(step_dir)
    require_listed(step_dir, [METADATA], manifest)
    metadata = read_dcp_metadata(step_dir / METADATA)
    files = {METADATA} | {info.relative_path for info in (metadata.storage_data or {}).values()}
    require_listed(step_dir, files, manifest)
    return files


@dataclass(frozen=True)
class Selection:
    """The commit to resume from, and what was passed over on the way (each with the reason)."""

    step_dir: Location | None
    step: int
    skipped: tuple[tuple[Location, str], ...] = ()
    warnings: tuple[str, ...] = ()


def select_commit(root: Location, on_damaged: OnDamaged = "fallback") -> Selection:
    """The newest committed step whose files verify.

    `latest` is a hint: when it is missing, unreadable or names something else, the newest verified commit
    is still found (with a warning). Damaged commits are skipped with a warning (`fallback`) or end the
    search with an error (`fail`). Commits present but none verifying is an error naming each one: a run
    never starts from scratch over committed work.
    """
    warnings: list[str] = []
    pointer = root / LATEST
    commits = committed_steps(root)
    named: str | None = None
    if pointer.exists():
        try:
            named = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            warnings.append(f"{pointer} is unreadable ({e}); looking for the newest verified commit")
        else:
            if not (root / named / MANIFEST).is_file():
                warnings.append(f"{pointer} names {named!r}, which is not a committed step directory")
    elif commits:
        warnings.append(f"{pointer} is missing; looking for the newest verified commit")
    skipped: list[tuple[Location, str]] = []
    for step_dir in reversed(commits):
        try:
            manifest = verify_manifest(step_dir)
        except CheckpointError as e:
            if on_damaged == "fail":
                raise CheckpointError(
                    f"the newest commit {step_dir} is damaged: {e} (checkpointing.on_damaged=fail; set it "
                    "to fallback to resume from the previous verified commit)"
                ) from None
            skipped.append((step_dir, str(e)))
            warnings.append(f"skipping damaged commit {step_dir}: {e}")
            continue
        if named is not None and named != step_dir.name and not skipped:
            warnings.append(f"{pointer} names {named!r}; the newest verified commit is {step_dir.name}")
        for message in warnings:
            _log.warning(message)
        return Selection(step_dir, int(manifest["step"]), tuple(skipped), tuple(warnings))
    if skipped:
        reasons = "\n  ".join(f"{path}: {why}" for path, why in skipped)
        raise CheckpointError(
            f"{root} holds committed checkpoints but none verifies; refusing to start from scratch over "
            f"them:\n  {reasons}\nRepair or move them away, or start a new run (another run.name or run.dir)."
        )
    for message in warnings:
        _log.warning(message)
    return Selection(None, 0, (), tuple(warnings))


def quarantine(step_dir: Location) -> Location:
    """Move a damaged commit out of the step sequence (kept for inspection, never written into)."""
    target = step_dir.parent / DAMAGED / f"{step_dir.name}-{time.strftime('%Y%m%dT%H%M%S')}"
    move_tree(step_dir, target)
    return target


def _serialized(state: Mapping[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


def dcp_problem(error: BaseException) -> str:
    """The informative line of a DCP load failure (it nests every rank's traceback), keys made readable."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    for line in reversed(lines):
        if (
            line.startswith(("ValueError", "RuntimeError", "KeyError"))
            or "CheckpointError: " in line
            or "mismatch" in line.lower()
        ):
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
            if _has_parameters(optimizer):
                optim.update(get_optimizer_state_dict(module, optimizer, options=_OPTIM_OPTIONS))
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        model, optim = state_dict["model"], state_dict["optim"]
        for module, optimizer in self.stages:
            own_model = {k: model[k] for k in self._model_state(module)}
            set_model_state_dict(module, own_model, options=StateDictOptions(strict=not self.trainable_only))
            if not _has_parameters(optimizer):
                continue
            own_optim = {
                k: optim[k] for k in get_optimizer_state_dict(module, optimizer, options=_OPTIM_OPTIONS)
            }
            set_optimizer_state_dict(module, optimizer, own_optim, options=_OPTIM_OPTIONS)


def _has_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """False for the optimizer of a pipeline stage that trains nothing (PEFT targets on other stages only):
    its flattened state, keyed by parameter names, is empty, which torch's state-dict API refuses."""
    return any(group["params"] for group in optimizer.param_groups)


class Checkpointer:
    """Saves and restores the engine's state through a `RunReporter` commit protocol."""

    def __init__(
        self,
        ctx: DistributedContext,
        root: Location,
        reporter: RunReporter,
        trainable_only: bool = False,
        identity: RunIdentity | None = None,
        train_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.ctx = ctx
        self.root = root
        self.reporter = reporter
        self.trainable_only = trainable_only
        self.identity = identity
        self.train_config = train_config

    def _prepare(self, step_dir: Location) -> str | None:
        """Main rank: make `step_dir` writable, or say why it must not be written."""
        self.root.mkdir(parents=True, exist_ok=True)
        if not step_dir.exists():
            return None
        if not is_committed(step_dir):
            remove_tree(step_dir)  # leftovers of an interrupted save of the same step
            return None
        try:
            verify_manifest(step_dir)
        except CheckpointError as e:
            moved = quarantine(step_dir)
            self.ctx.logger.warning("moved the damaged commit %s to %s (%s)", step_dir, moved, e)
            return None
        return (
            f"{step_dir} is already committed and verifies; a committed step is never written again "
            "(resume from it instead, or start a new run under another run.name or run.dir)"
        )

    def begin(self, step: int) -> Location:
        """Every rank (a collective): check that `step` may be written and return its directory."""
        step_dir = self.root / step_dir_name(step)
        problem = self._prepare(step_dir) if self.ctx.is_main_process else None
        problems = all_gather_object(problem) if self.ctx.is_distributed else [problem]
        refusal = next((p for p in problems if p is not None), None)
        if refusal is not None:
            raise CheckpointError(refusal)
        return step_dir

    def app_state(self, stages: StageOptimizers) -> dict[str, Any]:
        """The model and optimizer state as DCP saves it (tensors still on their devices)."""
        return {"app": _ModelAndOptimizerState(stages, self.trainable_only).state_dict()}

    def own_files(self, engine_state: Mapping[str, Any], rank_state: Mapping[str, Any]) -> dict[str, bytes]:
        """This rank's files besides DCP's, serialized now (the state keeps changing after the save step)."""
        own: dict[str, bytes] = {rank_state_name(self.ctx.rank): _serialized(rank_state)}
        if self.ctx.is_main_process:
            own[ENGINE_STATE] = _serialized(engine_state)
            if self.identity is not None:
                own[IDENTITY_FILE] = self.identity.to_json().encode()
            if self.train_config is not None:
                own[TRAIN_CONFIG] = (json.dumps(self.train_config, indent=1) + "\n").encode()
        return own

    def write(
        self,
        step: int,
        step_dir: Location,
        app_state: Mapping[str, Any],
        own: Mapping[str, bytes],
        process_group: ProcessGroup | None = None,
    ) -> RankCheckpointReport:
        """Write this rank's files of `step`, hashing them on the way; nothing is committed yet.

        `process_group` carries DCP's collectives (the default group when None); an asynchronous save
        passes a group of its own because it writes from another thread (`d9d.engine.async_save`)."""
        writer = hashing_writer(step_dir)
        dcp_save(
            dict(app_state), checkpoint_id=str(step_dir), storage_writer=writer, process_group=process_group
        )
        files: dict[str, WrittenFile] = writer.written
        for name, data in own.items():
            write_file(step_dir / name, data)
            files[name] = hashed_bytes(data)
        return RankCheckpointReport(
            step=step,
            rank=self.ctx.rank,
            step_dir=step_dir,
            files=tuple(CheckpointFile(n, f.size, f.sha256) for n, f in sorted(files.items())),
        )

    def commit(self, report: RankCheckpointReport) -> Location:
        """Every rank, after its files of the step are written: report them; rank 0 commits (collective)."""
        self.reporter.checkpoint_written(report)
        reports = gather_object(report, dst=0) if self.ctx.is_distributed else [report]
        if self.ctx.is_main_process:
            assert reports is not None
            self.reporter.commit_checkpoint(report.step, reports)
        self.ctx.barrier()
        return report.step_dir

    def save(
        self,
        step: int,
        stages: StageOptimizers,
        engine_state: Mapping[str, Any],
        rank_state: Mapping[str, Any],
    ) -> Location:
        """A synchronous save: write every rank's files, then commit."""
        step_dir = self.begin(step)
        app = {"app": _ModelAndOptimizerState(stages, self.trainable_only)}
        report = self.write(step, step_dir, app, self.own_files(engine_state, rank_state))
        return self.commit(report)

    def latest(self) -> Location | None:
        return self.reporter.latest_checkpoint()

    def load_engine_state(self, step_dir: Location) -> dict[str, Any]:
        require_listed(step_dir, [ENGINE_STATE])
        state = load_state_file(step_dir / ENGINE_STATE)
        if not isinstance(state, dict):
            raise CheckpointError(f"{step_dir / ENGINE_STATE} holds a {type(state).__name__}, not a mapping")
        return state

    def load(
        self,
        step_dir: Location,
        stages: StageOptimizers,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Restore model + optimizer in place; return (engine state, this rank's state or None).

        `step_dir` must be verified already (the reporter's `latest_checkpoint` and `resume_from` are).
        The rank state is None when the checkpoint came from a different world size (elastic restart):
        RNG streams cannot be mapped onto a new set of ranks, the rest of the state can.
        """
        manifest = read_manifest(step_dir)
        dcp_files(step_dir, manifest)  # listed, and a refusal names the file, not a DCP wrapper
        rank_file = step_dir / rank_state_name(self.ctx.rank)
        require_listed(step_dir, [ENGINE_STATE], manifest)
        try:
            dcp_load(
                {"app": _ModelAndOptimizerState(stages, self.trainable_only)},
                checkpoint_id=str(step_dir),
                storage_reader=safe_reader(step_dir),
                planner=SafeLoadPlanner(),
            )
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"cannot load {step_dir} into this model: {dcp_problem(e)}") from e
        engine_state = self.load_engine_state(step_dir)
        same_world = engine_state.get("world_size") == self.ctx.world_size
        rank_state = None
        if same_world and rank_file.exists():
            require_listed(step_dir, [rank_file.name], manifest)
            rank_state = load_state_file(rank_file)
        return engine_state, rank_state


class LocalRunReporter:
    """Reporter for launchers without a coordinator (single process, torchrun): the filesystem commits."""

    def __init__(
        self,
        checkpoint_root: Location,
        keep_last: int,
        metrics_sink: Any | None = None,
        on_damaged: OnDamaged = "fallback",
    ) -> None:
        self.root = checkpoint_root
        self.keep_last = keep_last
        self.metrics_sink = metrics_sink
        self.on_damaged: OnDamaged = on_damaged

    def metrics(self, point: Any) -> None:
        if self.metrics_sink is not None:
            self.metrics_sink(point)

    def commands(self, step: int) -> list[Any]:
        return []

    def checkpoint_written(self, report: RankCheckpointReport) -> None:
        return None

    def commit_checkpoint(self, step: int, reports: Sequence[RankCheckpointReport]) -> None:
        commit(self.root, step, reports, self.keep_last)

    def latest_checkpoint(self) -> Location | None:
        return select_commit(self.root, self.on_damaged).step_dir
