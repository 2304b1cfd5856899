"""The coordinator's side of the checkpoint commit protocol, on top of the engine's on-disk layout.

A step becomes `latest` only after every rank of the attempt reported its files and every file checks out
against its report (size, and sha256 as the bytes arrived in coordinator-storage mode). In that mode the
files arrive chunk by chunk through the Ray object store at the coordinator's node, where a `NodeStore`
actor (`d9d.cluster.transfer`) writes them with this class's `write_chunk` and hashes them as they arrive;
the coordinator's commit gets those hashes as `Arrival`s (metadata) and never touches the bytes. `latest`
is the newest commit whose files verify against its manifest (`d9d.engine.checkpoint.select_commit`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from d9d.core.storage import Location, remove_tree
from d9d.engine.checkpoint import (
    CheckpointError,
    OnDamaged,
    commit,
    is_committed,
    quarantine,
    read_manifest,
    select_commit,
    step_dir_name,
)
from d9d.engine.resume import ResumeDecision, ResumeError, check_resume
from d9d.engine.runtime import CheckpointFile, RankCheckpointReport

if TYPE_CHECKING:
    from d9d.cluster.spec import JobSpec

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommittedStep:
    step: int
    path: Location
    files: tuple[CheckpointFile, ...]


@dataclass(frozen=True)
class Arrival:
    """What arrived of one uploaded file so far: its size and the sha256 of the bytes in arrival order."""

    size: int
    sha256: str
    in_order: bool  # False: a chunk came at another offset than the end; the hash means nothing then


class _Incoming:
    """sha256 of a file arriving chunk by chunk, in order (the uploader sends them so)."""

    def __init__(self) -> None:
        self.digest: Any = hashlib.sha256()
        self.size = 0
        self.in_order = True

    def arrival(self) -> Arrival:
        return Arrival(self.size, self.digest.copy().hexdigest(), self.in_order)


class CheckpointStore:
    def __init__(self, root: Location, keep_last: int, on_damaged: OnDamaged = "fallback") -> None:
        self.root = root
        self.keep_last = keep_last
        self.on_damaged: OnDamaged = on_damaged
        self._incoming: dict[tuple[int, str], _Incoming] = {}
        # A commit of the attempt that just failed may still be running in its thread when the restart
        # clears uncommitted steps (a warm restart gets there in tens of milliseconds): one at a time, so
        # the clear never deletes the files of a commit that is writing its manifest.
        self._commit_lock = threading.Lock()

    def latest(self) -> CommittedStep | None:
        """The newest commit whose files verify (hashed once per coordinator process)."""
        step_dir = select_commit(self.root, self.on_damaged).step_dir
        if step_dir is None:
            return None
        manifest = read_manifest(step_dir)
        files = tuple(
            CheckpointFile(rel, int(info["size"]), str(info["sha256"]))
            for rel, info in sorted(manifest["files"].items())
        )
        return CommittedStep(int(manifest["step"]), step_dir, files)

    def commit(
        self,
        step: int,
        reports: Sequence[RankCheckpointReport],
        world_size: int,
        arrivals: Mapping[str, Arrival | None] | None = None,
    ) -> Location:
        """Check every rank's report against the stored files, then write the manifest and move `latest`.

        Files uploaded through the coordinator were hashed as their chunks arrived: by this store's own
        `write_chunk`, or, given `arrivals` (coordinator-storage mode, where a `NodeStore` actor received
        them), by that actor; then every file must have arrived whole, in order, with its reported sha256.
        Files the ranks wrote to shared storage were hashed by the ranks as they wrote them. Nothing is read
        back.
        """
        with self._commit_lock:
            return self._commit(step, reports, world_size, arrivals)

    def _commit(
        self,
        step: int,
        reports: Sequence[RankCheckpointReport],
        world_size: int,
        arrivals: Mapping[str, Arrival | None] | None,
    ) -> Location:
        ranks = sorted(r.rank for r in reports)
        if ranks != list(range(world_size)):
            missing = sorted(set(range(world_size)) - set(ranks))
            raise CheckpointError(f"step {step}: no checkpoint report from rank(s) {missing}")
        step_dir = self.root / step_dir_name(step)
        for report in reports:
            if report.step != step:
                raise CheckpointError(f"rank {report.rank} reported step {report.step} for step {step}")
            for f in report.files:
                path = step_dir / f.relative_path
                if not path.is_file() or path.stat().st_size != f.size_bytes:
                    raise CheckpointError(
                        f"rank {report.rank}: {path} is missing or not {f.size_bytes} bytes"
                    )
                incoming = self._incoming.pop((step, f.relative_path), None)
                if arrivals is not None:
                    _check_arrival(report.rank, path, f, arrivals.get(f.relative_path))
                    continue
                arrived = incoming is not None and incoming.in_order and incoming.size == f.size_bytes
                if arrived and incoming is not None and incoming.digest.hexdigest() != f.sha256:
                    raise CheckpointError(f"rank {report.rank}: {path} does not match its sha256")
        self._incoming = {k: v for k, v in self._incoming.items() if k[0] != step}
        return commit(self.root, step, reports, self.keep_last)

    def clear_uncommitted(self) -> None:
        """Before an attempt: move damaged commits newer than the newest verified one to `damaged/` (they
        are never written into; their steps will be saved afresh) and drop never-committed step
        directories newer than it (an interrupted attempt's)."""
        with self._commit_lock:
            self._clear_uncommitted()

    def _clear_uncommitted(self) -> None:
        selection = select_commit(self.root, self.on_damaged)
        for path, why in selection.skipped:
            moved = quarantine(path)
            _log.warning("moved the damaged commit %s to %s (%s)", path, moved, why)
        newest = selection.step_dir
        for path in self.root.glob("step-*"):
            if path.is_dir() and not is_committed(path) and (newest is None or path.name > newest.name):
                remove_tree(path)

    # -- coordinator-storage mode ----------------------------------------------------------------------

    def _file(self, step: int, relative_path: str) -> Path:
        if not isinstance(self.root, Path):  # build_job refuses this combination; a store has no chunks
            raise CheckpointError(
                f"coordinator storage keeps checkpoints on the coordinator, not {self.root}"
            )
        path = (self.root / step_dir_name(step) / relative_path).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise CheckpointError(f"checkpoint file {relative_path!r} escapes the checkpoint directory")
        return path

    def write_chunk(self, step: int, relative_path: str, offset: int, data: bytes) -> None:
        path = self._file(step, relative_path)
        if is_committed(path.parent):
            raise CheckpointError(f"{path.parent} is committed; a committed step is never written again")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("r+b" if offset > 0 else "wb") as f:
            f.seek(offset)
            f.write(data)
        key = (step, relative_path)
        incoming = self._incoming.setdefault(key, _Incoming()) if offset > 0 else _Incoming()
        self._incoming[key] = incoming
        if offset != incoming.size:
            incoming.in_order = False  # then the commit checks the size only, as for shared storage
        else:
            incoming.digest.update(data)
            incoming.size += len(data)

    def read_chunk(self, step: int, relative_path: str, offset: int, size: int) -> bytes:
        with self._file(step, relative_path).open("rb") as f:
            f.seek(offset)
            return f.read(size)

    def size(self, step: int, relative_path: str) -> int:
        return self._file(step, relative_path).stat().st_size

    def arrival(self, step: int, relative_path: str) -> Arrival | None:
        """What `write_chunk` received of this file so far (None: nothing since the last commit)."""
        incoming = self._incoming.get((step, relative_path))
        return None if incoming is None else incoming.arrival()

    def forget(self, step: int) -> None:
        """Drop the arrival records of `step` (committed, or abandoned with its attempt)."""
        self._incoming = {k: v for k, v in self._incoming.items() if k[0] != step}


def _check_arrival(rank: int, path: Path | Location, f: CheckpointFile, arrival: Arrival | None) -> None:
    if arrival is None or not arrival.in_order or arrival.size != f.size_bytes:
        got = "nothing"
        if arrival is not None:
            got = f"{arrival.size} bytes" + ("" if arrival.in_order else " out of order")
        raise CheckpointError(
            f"rank {rank}: {path} did not arrive whole at the coordinator's node ({got} of {f.size_bytes})"
        )
    if arrival.sha256 != f.sha256:
        raise CheckpointError(f"rank {rank}: {path} does not match its sha256")


class RunFinished(ResumeError):
    """The run's newest commit is at or past its last step: launching it would do nothing."""


def check_launch(spec: JobSpec) -> ResumeDecision:
    """The driver's resume decision for a new launch of `spec`, before any actor starts: raises
    `ResumeError` / `IdentityError` with the reason, `RunFinished` when there is nothing left to train."""
    decision = check_resume(spec.train)
    for message in decision.warnings:
        _log.warning("run %s: %s", spec.run_name, message)
    if decision.action == "finished":
        raise RunFinished(f"run {spec.run_name} {decision.message}")
    return decision
