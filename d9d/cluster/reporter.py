"""The `RunReporter` a rank actor hands to the engine: every call goes to the coordinator actor.

Nothing here may stall a training step on the coordinator, and a step should cost it as few calls as
possible: metric points are queued locally and leave with the next fire-and-forget call that goes anyway —
rank 0's step boundary (right after the step's points were reported) or the rank's heartbeat (every
`heartbeat_interval_s`). `commands()` keeps one long-poll outstanding and only checks (without waiting)
whether it has come back. Checkpoint calls do wait; they are the commit protocol.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from d9d.engine.checkpoint import sha256_of, step_dir_name
from d9d.engine.runtime import Command, MetricPoint, RankCheckpointReport


@dataclass(frozen=True)
class CoordinatorTransfer:
    """Coordinator-storage mode: where this rank keeps its files and how big each transfer chunk is."""

    local_root: Path
    chunk_bytes: int


class RayRunReporter:
    def __init__(
        self,
        coordinator: Any,
        attempt: int,
        rank: int,
        command_seq: int,
        transfer: CoordinatorTransfer | None,
    ) -> None:
        self._coordinator = coordinator
        self.attempt = attempt
        self._rank = rank
        self._command_seq = command_seq
        self._poll: Any = None
        self._boundary: int | None = None
        self._transfer = transfer
        self._pending: list[MetricPoint] = []
        self._lock = threading.Lock()

    def metrics(self, point: MetricPoint) -> None:
        with self._lock:
            self._pending.append(point)

    def take_pending(self) -> list[MetricPoint]:
        """Queued points, for the next call to the coordinator (also called from the heartbeat thread)."""
        with self._lock:
            points, self._pending = self._pending, []
        return points

    def flush(self) -> None:
        """Deliver queued points and wait for it (the last ones of a run)."""
        points = self.take_pending()
        if points:
            ray.get(self._coordinator.report.remote(self.attempt, points))

    def commands(self, step: int) -> Sequence[Command]:
        if step != self._boundary:
            self._boundary = step
            self._coordinator.boundary.remote(self.attempt, step, self.take_pending())
        if self._poll is None:
            self._poll = self._coordinator.next_commands.remote(self.attempt, self._command_seq)
        ready, _ = ray.wait([self._poll], timeout=0)
        if not ready:
            return []
        seq, commands = ray.get(self._poll)
        self._poll = None
        self._command_seq = seq
        return list(commands)

    def checkpoint_written(self, report: RankCheckpointReport) -> None:
        if self._transfer is not None:
            self._upload(report)
        ray.get(self._coordinator.checkpoint_written.remote(self.attempt, report))

    def commit_checkpoint(self, step: int, reports: Sequence[RankCheckpointReport]) -> None:
        ray.get(self._coordinator.commit.remote(self.attempt, step, list(reports)))

    def latest_checkpoint(self) -> Path | None:
        latest = ray.get(self._coordinator.latest.remote())
        if latest is None:
            return None
        if self._transfer is None:
            path: Path = latest.path
            return path
        return self._download(latest.step, latest.files)

    # -- coordinator-storage mode ----------------------------------------------------------------------

    def _upload(self, report: RankCheckpointReport) -> None:
        assert self._transfer is not None
        chunk = self._transfer.chunk_bytes
        for f in report.files:
            with (report.step_dir / f.relative_path).open("rb") as src:
                offset = 0
                while True:
                    data = src.read(chunk)
                    ref = ray.put(data)  # the bytes travel through the object store, not the call
                    ray.get(
                        self._coordinator.write_chunk.remote(
                            self.attempt, report.step, f.relative_path, offset, [ref]
                        )
                    )
                    offset += len(data)
                    if len(data) < chunk:
                        break
        # Older local steps are no longer needed: the coordinator holds everything committed.
        for old in self._transfer.local_root.glob("step-*"):
            if old.is_dir() and old.name < step_dir_name(report.step):
                shutil.rmtree(old, ignore_errors=True)

    def _download(self, step: int, files: Sequence[Any]) -> Path:
        assert self._transfer is not None
        step_dir = self._transfer.local_root / step_dir_name(step)
        for f in files:
            target = step_dir / f.relative_path
            if target.is_file() and target.stat().st_size == f.size_bytes and sha256_of(target) == f.sha256:
                continue  # this rank wrote it itself
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.part-{os.getpid()}")
            with partial.open("wb") as out:
                offset = 0
                while offset < f.size_bytes:
                    size = min(self._transfer.chunk_bytes, f.size_bytes - offset)
                    data = ray.get(self._coordinator.read_chunk.remote(step, f.relative_path, offset, size))
                    out.write(data)
                    offset += len(data)
            if sha256_of(partial) != f.sha256:
                raise RuntimeError(f"checkpoint file {f.relative_path} of step {step} arrived corrupted")
            os.replace(partial, target)
        return step_dir
