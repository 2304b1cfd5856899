"""The coordinator: one async Ray actor per run that owns the job.

It is the only writer to the tracker, the authority on which checkpoint is `latest`, and the mailbox for
control commands. This class is the actor's face (the calls clients and ranks make); the work is done by
the parts in `d9d.cluster.control`:

- `Controller`: the loop over attempts (reserve → run → restart or end) as states with one step function;
- `AttemptRunner` and `WorkerGroup`: start the ranks of one attempt, watch them, tear them down;
- `health`: the failure detectors a running attempt is checked against;
- `FailurePolicy`: retry with backoff or give up; `ScalingPolicy`: shrink to what fits, grow at commits;
- `MetricsHub`: numbered points for clients and the tracker writer; `CommandMailbox`: client requests;
- `journal`: the run's state on disk, so that a new coordinator can continue when this one dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from d9d.cluster.addresses import coordinator_repr
from d9d.cluster.checkpoints import Arrival, CheckpointStore, CommittedStep
from d9d.cluster.config import CoordinatorStorage
from d9d.cluster.control.controller import Controller
from d9d.cluster.control.failure import RankError
from d9d.cluster.control.journal import CommitRecord, Journal, spec_data, unfinished_journal, write_journal
from d9d.cluster.control.mailbox import CommandMailbox
from d9d.cluster.control.metrics import MetricsHub, loss_step, reports_pause
from d9d.cluster.control.signal import Changes
from d9d.cluster.control.workers import Attempt
from d9d.cluster.drain import DrainNotice, draining_nodes, notice
from d9d.cluster.lease import RENEW_S as LEASE_RENEW_S
from d9d.cluster.lease import Lease, LeaseLost, read_lease, renew
from d9d.cluster.lease import release as release_lease
from d9d.cluster.reporter import storage_stalls
from d9d.cluster.sink import MetricSink, MetricsWriter
from d9d.cluster.spec import JobSpec
from d9d.cluster.state import MAX_NOTICES, JobState, JobStatus, RunSummary
from d9d.cluster.transfer import TransferStats, start_node_store
from d9d.core.inflight import Operation
from d9d.engine.runtime import Command, CommandKind, MetricPoint, RankCheckpointReport

_COMMAND_POLL_S = 10.0
_JOURNAL_POLL_S = 60.0  # the journal is written on changes; this only bounds a missed wake-up
# Ray's draining nodes are asked this often (one GCS call); preemption notices give 30 s or more.
_DRAIN_POLL_S = 1.0
_UPLOAD_POLL_S = 0.02  # a commit waiting for uploads asks the node store this often (a metadata call)
_log = logging.getLogger(__name__)


class Coordinator:
    """Async actor; every method runs on one event loop, blocking work goes to threads."""

    def __init__(
        self,
        spec: JobSpec,
        sink_factory: Callable[[], MetricSink],
        launch_id: str = "",
        startup: dict[str, float] | None = None,
    ) -> None:
        self._spec = spec
        self._notice_count = 0
        ckpt = spec.train.checkpointing
        self._store = CheckpointStore(spec.checkpoint_dir, ckpt.keep_last, ckpt.on_damaged)
        self._changes = Changes()
        self._mailbox = CommandMailbox()
        self._metrics = MetricsHub(MetricsWriter(sink_factory))
        self._control = Controller(
            spec,
            self._store,
            self._mailbox,
            self._metrics,
            self._changes,
            launch_id=launch_id,
            notice=self._notice,
        )
        # The driver's start-up marks (`TrainingJob.start`): where the launch began and where its phases
        # before this actor ended (d9d.cluster.control.startup).
        marks = dict(startup or {})
        self._control.startup.started = marks.pop("started", self._control.startup.started)
        for phase, at in marks.items():
            self._control.startup.end(phase, at)
        self._main: asyncio.Task[None] | None = None
        self._launch_id = launch_id
        self._stalled: dict[int, tuple[Operation, float]] = {}  # this process's storage stalls named so far
        self._lease: Lease | None = None  # this launch's lease on the run (`d9d.cluster.lease`)
        self._lease_task: asyncio.Task[None] | None = None
        self._storage_task: asyncio.Task[None] | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._done = False  # terminal, summary written, tracker closed
        self._journal = self._open_journal(launch_id)
        self._journaled: tuple[object, ...] = ()
        self._journal_task: asyncio.Task[None] | None = None
        # Coordinator storage: the checkpoint bytes go to and from this actor on our node, never through
        # this one (d9d.cluster.transfer); here only their metadata passes, counted for `transfer_stats`.
        self._node_store: Any = None
        if isinstance(spec.cluster.storage, CoordinatorStorage) and isinstance(spec.checkpoint_dir, Path):
            # (build_job refuses coordinator storage under an object-store root)
            self._node_store = start_node_store(spec.checkpoint_dir, ckpt.keep_last)
        self._storage_call_bytes = 0
        try:
            gcs: str | None = ray.get_runtime_context().gcs_address
        except Exception:  # outside an actor (unit tests)
            gcs = None
        self._repr = coordinator_repr(spec.run_name, str(spec.run_dir), gcs)

    def __repr__(self) -> str:
        """Ray's state API lists it (`repr_name`): `d9d status/list --address http://head:8265` find the run's
        directory and the cluster's Ray address from the dashboard URL alone (d9d.cluster.addresses)."""
        return self._repr

    def _open_journal(self, launch_id: str) -> Journal:
        """This coordinator's journal, continuing the one of a coordinator of this run that died: the
        attempt numbering goes on (the engine resumes attempt > 0 from the run's own commits, as after
        any restart), and so do the commit history and the losses up to the newest commit."""
        spec = self._spec
        previous = unfinished_journal(spec.run_dir, spec.run_name)
        context = ray.get_runtime_context()
        journal = Journal(
            run_name=spec.run_name,
            launch_id=launch_id,
            spec=spec_data(spec),
            state=JobState.PENDING,
            launches=[launch_id],
            node_id=context.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
        )
        if previous is not None:
            newest = previous.latest_commit
            losses = {s: v for s, v in previous.losses.items() if newest is not None and s <= newest}
            journal = journal.model_copy(
                update={
                    "attempts": previous.attempts,
                    "commits": previous.commits,
                    "losses": losses,
                    "launches": [*previous.launches, launch_id],
                }
            )
            self._control.attempts = previous.attempts
            self._metrics.losses.update(losses)
            if newest is not None:
                self._metrics.step_seen(newest)
            _log.warning(
                "run %s: continuing after a coordinator that died (launch %s, %d attempts, newest commit %s)",
                spec.run_name,
                previous.launch_id,
                previous.attempts,
                newest,
            )
        write_journal(spec.run_dir, journal)
        return journal

    # == client API ======================================================================================

    async def start(self) -> None:
        if self._main is None:
            self._control.startup.end("coordinator")
            loop = asyncio.get_running_loop()
            if self._launch_id:
                await asyncio.to_thread(self._renew_lease)  # the driver's lease is this actor's from now on
                self._lease_task = loop.create_task(self._keep_lease())
            self._journal_task = loop.create_task(self._keep_journal())
            self._storage_task = loop.create_task(self._watch_storage())
            self._drain_task = loop.create_task(self._watch_drain())
            self._main = loop.create_task(self._run_job())

    async def spec(self) -> JobSpec:
        return self._spec

    async def journal(self) -> Journal:
        """What this coordinator last wrote to `<run dir>/coordinator.json` (its pid and node included)."""
        return self._journal

    async def status(self) -> JobStatus:
        c = self._control
        at = c.attempt
        return JobStatus(
            run_name=self._spec.run_name,
            state=c.machine.state,
            step=self._metrics.last_step,
            total_steps=self._spec.train.trainer.total_steps,
            attempt=c.attempts - 1,
            world_size=at.plan.world_size if at else 0,
            data_parallel=at.plan.data_parallel if at else 0,
            restarts=max(c.attempts - 1, 0),
            latest_checkpoint_step=c.latest_step,
            last_loss=self._metrics.last_loss,
            last_failure=c.failures.failures[-1] if c.failures.failures else None,
            error=c.summary.error,
            failures=len(c.failures.failures),
            notices=tuple(c.summary.notices[-20:]),
            notice_count=self._notice_count,
            asleep=self._metrics.asleep and not c.machine.state.terminal,
            standby_ready=c.standby_ready,
            startup=tuple(c.startup.phases().items()),
            starting=c.startup.current(),
        )

    async def send(self, command: Command) -> None:
        state = self._control.machine.state
        if state.terminal:
            raise RuntimeError(f"run {self._spec.run_name} has already ended ({state.value})")
        self._mailbox.post(command)
        if command.kind is CommandKind.STOP and command.values.get("reason"):
            self._control.summary.stop_reason = str(command.values["reason"])
        if command.kind is CommandKind.RESUME:
            self._control.resumed()
        await self._changes.notify()

    async def kill(self, reason: str | None = None) -> None:
        """Stop now without waiting for a step boundary (ranks are killed, nothing is saved)."""
        if reason:
            self._control.summary.stop_reason = reason
        self._mailbox.request_kill()
        await self._changes.notify()

    async def metrics_since(self, seq: int, timeout_s: float) -> tuple[int, list[MetricPoint], bool]:
        """Points after `seq` (waits up to `timeout_s` for new ones); also says whether the job ended."""
        await self._changes.wait_until(lambda: self._metrics.seq > seq or self._done, timeout_s)
        return self._metrics.seq, self._metrics.since(seq), self._done

    async def wait(self, step: int | None, timeout_s: float) -> JobStatus:
        def reached() -> bool:
            return self._control.machine.state.terminal or (
                step is not None and self._metrics.last_step >= step
            )

        await self._changes.wait_until(reached, timeout_s)
        return await self.status()

    async def result(self, timeout_s: float) -> RunSummary | None:
        await self._changes.wait_until(lambda: self._done, timeout_s)
        return self._control.summary if self._done else None

    # == rank API ========================================================================================

    async def report(self, attempt: int, points: list[MetricPoint]) -> None:
        if self._control.current(attempt):
            await self._accept(points)

    async def heartbeat(self, attempt: int, rank: int) -> None:
        at = self._control.current(attempt)
        if at is not None:
            at.live.heartbeats[rank] = time.monotonic()

    async def rank_failed(self, attempt: int, error: RankError) -> None:
        """A rank raised (it calls this before tearing its process group down): the attempt's runner
        blames the first rank's own exception, not the broken collectives it causes on the others."""
        at = self._control.current(attempt)
        if at is not None:
            at.live.errors.append(dataclasses.replace(error, seen_at=time.monotonic()))
            await self._changes.notify()

    async def setup_mark(self, attempt: int, phase: str, at: float) -> None:
        """Rank 0 ended a start-up phase of its own (`process_group`, `build`, `load`) at wall time `at`."""
        if self._control.current(attempt) is not None:
            self._control.startup_mark(attempt, phase, at)
            await self._changes.notify()

    async def notice(self, attempt: int, text: str) -> None:
        """Something the user should see now (a rank's storage stall): logged, on `d9d train`'s console
        through `status()`, and in the summary's `notices`."""
        if self._control.current(attempt) is not None:
            await self._notice(text)

    async def _notice(self, text: str) -> None:
        _log.warning("run %s: %s", self._spec.run_name, text)
        notices = self._control.summary.notices
        notices.append(text)
        del notices[:-MAX_NOTICES]
        self._notice_count += 1
        await self._changes.notify()

    async def _watch_storage(self) -> None:
        """Name this process's own stalled storage operations (commits, the journal) as ranks do theirs."""
        while not self._done:
            await self._changes.wait_until(lambda: self._done, 1.0)
            for text in storage_stalls(self._stalled, self._spec.cluster.storage_stall_s, time.monotonic()):
                await self._notice(f"coordinator: {text}")

    async def _watch_drain(self) -> None:
        """A rank's node (or this actor's) that Ray drains is a preemption (`d9d.cluster.drain`): once."""
        unknown = False
        while not self._done:
            await self._changes.wait_until(lambda: self._done, _DRAIN_POLL_S)
            if self._done:
                return
            draining = await asyncio.to_thread(draining_nodes)
            if draining is None:
                if not unknown:
                    _log.warning(
                        "run %s: this Ray does not say which nodes drain; a preemption notice of a rank's "
                        "node is not seen (SIGTERM to the driver still is)",
                        self._spec.run_name,
                    )
                unknown = True
                continue
            at = self._control.attempt
            found = notice(draining, [n.node_id for n in at.nodes] if at else [], self._journal.node_id)
            if found is not None and not self._control.machine.state.terminal:
                await self._preempted(found)
                return

    async def _preempted(self, drain: DrainNotice) -> None:
        """Stop at the next step boundary, which the ranks commit, as the driver does on SIGTERM; kill the
        ranks if they have not stopped within `cluster.preemption_grace_s` or by the node's deadline."""
        reason = drain.reason()
        grace = max(0.0, min(self._spec.cluster.preemption_grace_s, drain.remaining_s()))
        await self._notice(f"{reason}: stopping at the next step boundary, which is saved (<= {grace:.0f}s)")
        try:
            await self.send(Command(CommandKind.STOP, {"reason": reason}))
        except RuntimeError:  # it ended meanwhile
            return
        await self._changes.wait_until(lambda: self._done, grace)
        if not self._done:
            await self.kill(reason=f"{reason}: not stopped within {grace:.0f}s, killed")

    async def boundary(self, attempt: int, step: int, points: list[MetricPoint]) -> None:
        """Rank 0 reached a step boundary (sent once per step, with the points reported since the last
        one): the job's progress signal."""
        at = self._control.current(attempt)
        if at is None:
            return
        at.live.progress = time.monotonic()
        await self._accept(points)  # first: a grow decided at this step waits for its loss (step_seen)
        self._control.step_seen(step)

    async def next_commands(self, attempt: int, seq: int) -> tuple[int, list[Command]]:
        """Long poll of rank 0: commands issued after `seq`."""

        def ready() -> bool:
            return self._mailbox.seq > seq or not self._control.current(attempt)

        await self._changes.wait_until(ready, _COMMAND_POLL_S)
        if not self._control.current(attempt):
            return seq, []
        return self._mailbox.since(seq)

    async def checkpoint_written(self, attempt: int, report: RankCheckpointReport) -> None:
        self._require_current(attempt).live.progress = time.monotonic()
        self._count(report)

    async def node_store(self) -> Any:
        """Coordinator storage: the handle of the actor that keeps the checkpoint files on this node."""
        if self._node_store is None:
            raise RuntimeError(f"run {self._spec.run_name} keeps its checkpoints on shared storage")
        return self._node_store

    async def uploaded(self, attempt: int, rank: int, step: int, nbytes: int) -> None:
        """A rank finished uploading its files of `step` (a background upload is progress)."""
        at = self._control.current(attempt)
        if at is not None:
            at.live.progress = time.monotonic()

    async def commit(
        self,
        attempt: int,
        step: int,
        reports: Sequence[RankCheckpointReport],
        points: list[MetricPoint],
    ) -> None:
        """Rank 0 commits `step`, with its points not yet delivered (the step's loss among them): accepted
        first, so that a committed step's loss is never lost to an attempt ended right after."""
        at = self._require_current(attempt)
        await self._accept(points)
        self._count(reports)
        arrivals = None
        if self._node_store is not None:
            arrivals = await self._uploads_arrived(attempt, step, reports)
            self._require_current(attempt)
        await asyncio.to_thread(self._store.commit, step, reports, at.plan.world_size, arrivals)
        if self._node_store is not None:
            self._node_store.forget.remote(step)
        record = CommitRecord(step=step, attempt=attempt, world_size=at.plan.world_size, at=time.time())
        self._journal = self._journal.model_copy(update={"commits": [*self._journal.commits, record]})
        self._control.committed(at, step)
        await self._changes.notify()

    async def latest(self) -> CommittedStep | None:
        latest = await asyncio.to_thread(self._store.latest)
        self._count(latest)
        return latest

    async def transfer_stats(self) -> tuple[int, TransferStats | None]:
        """(bytes of the storage calls through this actor: reports, commits, `latest`, arrivals; the node
        store's counters, None with shared storage)."""
        node = None if self._node_store is None else await self._node_store.stats.remote()
        return self._storage_call_bytes, node

    async def _uploads_arrived(
        self, attempt: int, step: int, reports: Sequence[RankCheckpointReport]
    ) -> dict[str, Arrival | None]:
        """Wait until every reported file of `step` arrived at the node store (or can no longer arrive
        right: too many bytes, out of order), while `attempt` is current; returns the arrivals."""
        expected = {f.relative_path: f.size_bytes for r in reports for f in r.files}
        names = sorted(expected)
        seen = -1
        while True:
            arrivals: dict[str, Arrival | None] = await self._node_store.arrived.remote(attempt, step, names)
            self._count(arrivals)
            if all(
                a is not None and (a.size >= expected[rel] or not a.in_order) for rel, a in arrivals.items()
            ):
                return arrivals
            at = self._require_current(attempt)  # a rank died mid-upload: this commit never happens
            arrived = sum(a.size for a in arrivals.values() if a is not None)
            if arrived != seen:
                at.live.progress = time.monotonic()
                seen = arrived
            await asyncio.sleep(_UPLOAD_POLL_S)

    def _count(self, value: object) -> None:
        self._storage_call_bytes += len(pickle.dumps(value))

    # == the job =========================================================================================

    async def _run_job(self) -> None:
        state = JobState.FAILED
        try:
            await asyncio.to_thread(self._control.record_start)
            state = await self._control.run()
        except Exception:
            self._control.summary.error = traceback.format_exc()
            _log.error("run %s failed:\n%s", self._spec.run_name, self._control.summary.error)
        finally:
            await self._control.teardown()
            final = self._control.finish(state)
            await asyncio.to_thread(self._metrics.close, JobState(final.status))
            self._done = True
            await self._changes.notify()
            if self._journal_task is not None:
                # The terminal state is on disk before the actor may go; the writer logs its own errors.
                with contextlib.suppress(Exception):
                    await self._journal_task
            if self._lease_task is not None:  # the run is over: another launch may start it again
                with contextlib.suppress(Exception):
                    await self._lease_task
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(release_lease, self._spec.run_dir, self._launch_id)
            if self._spec.cluster.detach:
                await asyncio.sleep(self._spec.cluster.linger_s)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _renew_lease(self) -> None:
        spec = self._spec
        lease = self._lease or read_lease(spec.run_dir)
        if lease is None or lease.launch_id != self._launch_id:
            held = "nobody" if lease is None else lease.describe()
            raise LeaseLost(f"run {spec.run_name}: launch {self._launch_id} does not hold the lease ({held})")
        self._lease = renew(
            spec.run_dir, lease, owner="coordinator", host=socket.gethostname(), pid=os.getpid()
        )

    async def _keep_lease(self) -> None:
        """Renew the launch's lease until the run ended; a lease another launch took over ends the run
        (two launches must not train one run side by side)."""
        while not self._done:
            await self._changes.wait_until(lambda: self._done, LEASE_RENEW_S)
            if self._done:
                return
            try:
                await asyncio.to_thread(self._renew_lease)
            except LeaseLost as e:
                _log.error("%s: ending this launch", e)
                self._control.summary.error = str(e)
                self._mailbox.request_kill()
                await self._changes.notify()
                return
            except OSError as e:  # a full or unreachable disk: the next renewal may succeed
                _log.warning("run %s: cannot renew the launch lease: %s", self._spec.run_name, e)

    async def _keep_journal(self) -> None:
        """Rewrite the journal whenever what it records changed: an attempt started, a commit was made or
        rank 0 reported the committed step's loss, the job changed state. Runs until the job ended."""
        while True:
            await self._changes.wait_until(lambda: self._journal_key() != self._journaled, _JOURNAL_POLL_S)
            key = self._journal_key()
            if key != self._journaled:
                await self._persist_journal()
                self._journaled = key
            if self._done:
                return

    def _journal_key(self) -> tuple[object, ...]:
        newest = self._journal.latest_commit
        reported = newest is not None and self._metrics.last_step >= newest
        return (self._control.attempts, newest, reported, self._control.machine.state, self._done)

    async def _persist_journal(self) -> None:
        newest = self._journal.latest_commit
        losses = {s: v for s, v in self._metrics.losses.items() if newest is not None and s <= newest}
        self._journal = self._journal.model_copy(
            update={
                "attempts": self._control.attempts,
                "state": self._control.machine.state,
                "losses": losses,
            }
        )
        try:  # off the event loop: the fsync may take long on a network disk
            await asyncio.to_thread(write_journal, self._spec.run_dir, self._journal)
        except OSError as e:  # a full or unreachable disk must not end the run it journals
            _log.error("run %s: cannot write the coordinator journal: %s", self._spec.run_name, e)

    def _require_current(self, attempt: int) -> Attempt:
        at = self._control.current(attempt)
        if at is None:
            raise RuntimeError(f"attempt {attempt} is no longer the current attempt of this run")
        return at

    async def _accept(self, points: list[MetricPoint]) -> None:
        for point in points:
            self._metrics.add(point)  # first: a grow waiting for this step's loss sees it (step_seen)
            step = loss_step(point)
            if step is not None:
                self._control.step_seen(step)
            if reports_pause(point):
                self._control.ranks_paused()
        await self._changes.notify()
