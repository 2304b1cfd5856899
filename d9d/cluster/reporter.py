"""The `RunReporter` a rank actor hands to the engine: every call goes to the coordinator actor.

Nothing here may stall a training step on the coordinator, and a step should not pay for a Ray call at all:
submitting one costs a few hundred microseconds of the caller's CPU, as much as a whole step of a small
model. So the step path only touches local memory. A courier thread carries queued metric points and rank
0's step boundary to the coordinator (at most every `courier_interval_s`, and a heartbeat every
`heartbeat_interval_s`), and on rank 0 a listener thread keeps one long-poll for commands outstanding and
queues what it returns for the next step boundary. Checkpoint calls do wait; they are the commit protocol.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import ray

from d9d.core.files import atomic_write
from d9d.engine.checkpoint import sha256_of, step_dir_name
from d9d.engine.runtime import CheckpointFile, Command, MetricPoint, RankCheckpointReport

_log = logging.getLogger(__name__)


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
        heartbeat_interval_s: float = 0.5,
        courier_interval_s: float = 0.05,
    ) -> None:
        self._coordinator = coordinator
        self.attempt = attempt
        self._rank = rank
        self._command_seq = command_seq
        self._transfer = transfer
        self._heartbeat_s = heartbeat_interval_s
        self._courier_s = courier_interval_s
        self._lock = threading.Lock()
        self._pending: list[MetricPoint] = []
        self._step: int | None = None  # rank 0's latest step boundary
        self._commands: list[Command] = []
        self._listener: threading.Thread | None = None
        self._stop = threading.Event()
        self._courier = threading.Thread(target=self._carry, name="d9d-courier", daemon=True)

    def start(self) -> RayRunReporter:
        self._courier.start()
        return self

    def close(self) -> None:
        """Stop the threads and deliver what is still queued, waiting for it (the last points of a run)."""
        self._stop.set()
        if self._courier.is_alive():
            self._courier.join()
        self._send(wait=True)

    # -- the step path: local memory only ----------------------------------------------------------------

    def metrics(self, point: MetricPoint) -> None:
        with self._lock:
            self._pending.append(point)

    def commands(self, step: int) -> Sequence[Command]:
        if self._listener is None:
            self._listener = threading.Thread(target=self._listen, name="d9d-commands", daemon=True)
            self._listener.start()
        with self._lock:
            self._step = step
            commands, self._commands = self._commands, []
        return commands

    # -- background threads ------------------------------------------------------------------------------

    def _send(self, wait: bool = False, last_step: int | None = None) -> int | None:
        """One call with the queued points: a boundary when rank 0 moved past `last_step`, else a report."""
        with self._lock:
            points, self._pending = self._pending, []
            step = self._step
        if step is not None and step != last_step:
            ref = self._coordinator.boundary.remote(self.attempt, step, points)
        elif points:
            ref = self._coordinator.report.remote(self.attempt, points)
        else:
            return last_step
        if wait:
            ray.get(ref)
        return step

    def _carry(self) -> None:
        """Courier: the step boundary and metric points every `courier_interval_s`, liveness on its own
        schedule (a rank deep in a long step still beats)."""
        sent_step: int | None = None
        next_beat = 0.0
        while not self._stop.wait(self._courier_s):
            try:
                sent_step = self._send(last_step=sent_step)
                if time.monotonic() >= next_beat:
                    self._coordinator.heartbeat.remote(self.attempt, self._rank)
                    next_beat = time.monotonic() + self._heartbeat_s
            except Exception:  # the coordinator is gone: its supervisor tears this rank down
                _log.debug("courier call failed", exc_info=True)

    def _listen(self) -> None:
        """Rank 0: one long-poll for commands outstanding at all times; results wait for the next boundary."""
        while not self._stop.is_set():
            try:
                seq, commands = ray.get(
                    self._coordinator.next_commands.remote(self.attempt, self._command_seq)
                )
            except Exception:
                _log.debug("command poll failed", exc_info=True)
                return
            if commands:
                with self._lock:
                    self._commands.extend(commands)
            self._command_seq = seq

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

    def _download(self, step: int, files: Sequence[CheckpointFile]) -> Path:
        assert self._transfer is not None
        step_dir = self._transfer.local_root / step_dir_name(step)
        for f in files:
            target = step_dir / f.relative_path
            if target.is_file() and target.stat().st_size == f.size_bytes and sha256_of(target) == f.sha256:
                continue  # this rank wrote it itself
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(target, functools.partial(self._fetch, step, f))
        return step_dir

    def _fetch(self, step: int, f: CheckpointFile, out: BinaryIO) -> None:
        """Write one committed file into `out`, checking it against its sha256 before it is kept."""
        assert self._transfer is not None
        digest = hashlib.sha256()
        offset = 0
        while offset < f.size_bytes:
            size = min(self._transfer.chunk_bytes, f.size_bytes - offset)
            data = ray.get(self._coordinator.read_chunk.remote(step, f.relative_path, offset, size))
            out.write(data)
            digest.update(data)
            offset += len(data)
        if digest.hexdigest() != f.sha256:
            raise RuntimeError(f"checkpoint file {f.relative_path} of step {step} arrived corrupted")
