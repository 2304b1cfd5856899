"""The `RunReporter` a rank actor hands to the engine: every call goes to the coordinator actor.

Nothing here may stall a training step on the coordinator, and a step should not pay for a Ray call at all:
submitting one costs a few hundred microseconds of the caller's CPU, as much as a whole step of a small
model. So the step path only touches local memory. A courier thread carries queued metric points and rank
0's step boundary to the coordinator (at most every `courier_interval_s`, and a heartbeat every
`heartbeat_interval_s`), and on rank 0 a listener thread keeps one long-poll for commands outstanding and
queues what it returns for the next step boundary. Checkpoint calls do wait; they are the commit protocol
(with shared storage). In coordinator-storage mode the files go to the coordinator's node in the background
and rank 0's commit is queued behind them (`d9d.cluster.transfer`): a checkpoint call then waits only for
the previous checkpoint's upload and commit, and `close` for the last one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch.distributed as dist

from d9d.cluster.transfer import CoordinatorTransfer, Fetcher, Uploader, upload_report
from d9d.core.inflight import Operation, operations
from d9d.engine.runtime import Command, MetricPoint, RankCheckpointReport

__all__ = ["CoordinatorTransfer", "RayRunReporter"]

_log = logging.getLogger(__name__)


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
        storage_stall_s: float = 10.0,
    ) -> None:
        self._coordinator = coordinator
        self.attempt = attempt
        self._rank = rank
        self._command_seq = command_seq
        self._transfer = transfer
        self._heartbeat_s = heartbeat_interval_s
        self._courier_s = courier_interval_s
        self._stall_s = storage_stall_s
        self._stalled: dict[int, tuple[Operation, float]] = {}  # reported stalls: op id -> (op, last said)
        self._lock = threading.Lock()
        # Held while points are taken and their call submitted (and, by a commit, while the call before it
        # is waited for): a commit then knows every call that carries points queued before it.
        self._send_lock = threading.Lock()
        self._in_flight: Any = None  # the last call that carried points, not known to have arrived
        self._pending: list[MetricPoint] = []
        self._step: int | None = None  # rank 0's latest step boundary
        self._commands: list[Command] = []
        self._listener: threading.Thread | None = None
        self._stop = threading.Event()
        self._courier = threading.Thread(target=self._carry, name="d9d-courier", daemon=True)
        self._uploader: Uploader | None = None
        self._node_store: Any = None
        self.fetched_bytes = 0  # checkpoint bytes this rank fetched from the coordinator's node

    def start(self) -> RayRunReporter:
        self._courier.start()
        return self

    def close(self) -> None:
        """Finish the queued uploads and commit (the courier keeps beating meanwhile), stop the threads and
        deliver what is still queued, waiting for it (the last points of a run). Raises when an upload or
        the commit failed: that checkpoint is not committed, and the attempt must not end as if it were."""
        try:
            if self._uploader is not None:
                self._uploader.close()
        finally:
            self._stop.set()
            if self._courier.is_alive():
                self._courier.join()
            try:
                self._report_stalls()  # a stall that just ended is said before the rank's last points
            except Exception:
                _log.debug("stall report failed", exc_info=True)
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
        """One call with the queued points: a boundary when rank 0 moved past `last_step`, else a report.
        One such call in flight at a time: the coordinator is an asynchronous actor, and Ray runs two calls
        of one caller on it out of order when the first one's arguments are large enough to go through the
        object store (a big batch of points) and the second one's are not; a step's points would then reach
        it, and the clients' `metrics()`, after a later step's. So while the previous call has not
        arrived, the points stay queued for the next tick (without `wait`) or that call is waited for.
        With `wait`, returns once this call arrived."""
        with self._send_lock:
            earlier = self._in_flight
            if earlier is not None:
                if not wait and not _done(earlier):
                    return last_step
                self._in_flight = None
                self._arrived(earlier)
            with self._lock:
                points, self._pending = self._pending, []
                step = self._step
            if step is not None and step != last_step:
                ref = self._coordinator.boundary.remote(self.attempt, step, points)
            elif points:
                ref = self._coordinator.report.remote(self.attempt, points)
            else:
                ref = None
            self._in_flight = ref
            if wait:
                self._arrived(ref)
                self._in_flight = None
        return last_step if ref is None else step

    def _arrived(self, ref: Any) -> None:
        """Wait for a call that carried points (raising what it raised)."""
        if ref is not None:
            ray.get(ref)

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
                    self._report_stalls()
            except Exception:  # the coordinator is gone: its supervisor tears this rank down
                _log.debug("courier call failed", exc_info=True)

    def notice(self, text: str) -> None:
        """Something the user should see now (what a resume changes): on `d9d train`'s console and in the
        summary's `notices`, through the coordinator."""
        with contextlib.suppress(Exception):  # the coordinator is gone: its supervisor tears this rank down
            self._coordinator.notice.remote(self.attempt, text)

    def _report_stalls(self) -> None:
        """Name storage operations of this process in flight for `storage_stall_s` (again every as long),
        and those that ended after being named."""
        for text in storage_stalls(self._stalled, self._stall_s, time.monotonic()):
            self._coordinator.notice.remote(self.attempt, f"rank {self._rank}: {text}")

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
            uploads = self._uploads()
            uploads.wait()  # one step in flight: the previous step's upload (and rank 0's commit) is done
            uploads.submit(functools.partial(self._upload, self._store(), report))
        ray.get(self._coordinator.checkpoint_written.remote(self.attempt, report))

    def commit_checkpoint(self, step: int, reports: Sequence[RankCheckpointReport]) -> None:
        commit = functools.partial(self._commit, step, list(reports))
        if self._transfer is not None:
            self._uploads().submit(commit)  # after this rank's own upload; the coordinator waits for the rest
        else:
            commit()

    def latest_checkpoint(self) -> Path | None:
        latest = ray.get(self._coordinator.latest.remote())
        if latest is None:
            return None
        if self._transfer is None:
            path: Path = latest.path
            return path
        world_size = dist.get_world_size() if dist.is_initialized() else None
        fetcher = Fetcher(self._store(), self._rank, self._transfer)
        result = fetcher.fetch(latest.step, latest.files, world_size)
        self.fetched_bytes += result.fetched_bytes
        _log.info(
            "fetched %d of %d bytes of step %d from the coordinator's node",
            result.fetched_bytes,
            sum(f.size_bytes for f in latest.files),
            latest.step,
        )
        return result.step_dir

    # -- coordinator-storage mode ----------------------------------------------------------------------

    def _commit(self, step: int, reports: list[RankCheckpointReport]) -> None:
        """The commit carries the points still queued, after the courier's last call arrived: the step's loss
        reaches the coordinator no later than the commit does. A restart resumes after the committed step
        and never reports its loss again, and an attempt ended right after a commit (a resize) loses what
        the courier had not delivered."""
        with self._send_lock:  # not for the commit itself: a long one would hold the courier's heartbeats
            with self._lock:
                points, self._pending = self._pending, []
            self._arrived(self._in_flight)
            self._in_flight = None
            ref = self._coordinator.commit.remote(self.attempt, step, reports, points)
        ray.get(ref)

    def _uploads(self) -> Uploader:
        if self._uploader is None:
            self._uploader = Uploader()
        return self._uploader

    def _store(self) -> Any:
        """The coordinator's `NodeStore` (asked once: the handle is all the coordinator hands out)."""
        if self._node_store is None:
            self._node_store = ray.get(self._coordinator.node_store.remote())
        return self._node_store

    def _upload(self, store: Any, report: RankCheckpointReport) -> None:
        assert self._transfer is not None
        nbytes = upload_report(store, self.attempt, report, self._transfer)
        # A long upload at the end of a run is progress, as a step boundary is (the hang detector).
        self._coordinator.uploaded.remote(self.attempt, self._rank, report.step, nbytes)


def _done(ref: Any) -> bool:
    """Whether a call has finished (its result, or its error, is there), without waiting for it."""
    ready, _ = ray.wait([ref], timeout=0, fetch_local=False)
    return bool(ready)


def storage_stalls(stalled: dict[int, tuple[Operation, float]], stall_s: float, now: float) -> list[str]:
    """What to say about this process's storage operations now (updating `stalled`, the ones said so far):
    one in flight for `stall_s` (and every `stall_s` after), and one that ended after it was said."""
    texts = []
    live = {op.id: op for op in operations()}
    for op_id, (op, _) in list(stalled.items()):
        if op_id not in live:
            del stalled[op_id]
            texts.append(
                f"storage: {op.what} {op.where} ({op.store}) done after about {now - op.started:.0f}s"
            )
    for op in live.values():
        said = stalled.get(op.id)
        if now - op.started >= stall_s and (said is None or now - said[1] >= stall_s):
            stalled[op.id] = (op, now)
            texts.append(f"storage stalled: {op.describe(now)}, still waiting")
    return texts
