"""The loop over attempts, as states and one step function that picks the next state.

    Reserve ──▶ Run ──Finished/Stopped──────────────────────────▶ End
       ▲         │
       │         └──Failed/Resize──▶ Restart ──FailurePolicy gives up──▶ End(failed)
       └──────── backoff (none for a resize) ──┘

Each controller state puts the job in a `JobState` (Reserve: starting; Run: running once the ranks run;
Restart: restarting; End: terminal), through the `StateMachine`, whose table says which changes are legal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from d9d.cluster.checkpoints import CheckpointStore
from d9d.cluster.control.failure import FailureDecision, FailurePolicy, GiveUp, Retry
from d9d.cluster.control.health import Liveness
from d9d.cluster.control.mailbox import CommandMailbox
from d9d.cluster.control.metrics import CLUSTER_RANK, MetricsHub
from d9d.cluster.control.outcome import Failed, Finished, Outcome, Resize, Stopped
from d9d.cluster.control.recovery import RecoveryClock, detect_seconds
from d9d.cluster.control.runner import AttemptRunner
from d9d.cluster.control.scaling import ScalingPolicy
from d9d.cluster.control.signal import Changes
from d9d.cluster.control.standby import Standby, StandbyPool
from d9d.cluster.control.startup import StartupClock
from d9d.cluster.control.workers import Attempt, NoResources, Reservation, WorkerGroup
from d9d.cluster.elastic import WorldPlan
from d9d.cluster.spec import JobSpec
from d9d.cluster.state import JobState, RunSummary, StateMachine, record_launch
from d9d.engine.checkpoint import step_dir_name
from d9d.engine.runtime import MetricPoint, RankResult, reports_train_metrics

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reserve:
    """Reserve bundles for the largest valid layout up to `target` ranks that fits."""

    target: int
    growing: bool  # a resize asked for `target`


@dataclass(frozen=True)
class Run:
    """Start the attempt's ranks and watch them until it ends."""

    attempt: Attempt


@dataclass(frozen=True)
class Restart:
    """Tear the attempt down, then act on the decision (Retry(0) for a resize)."""

    target: int
    growing: bool
    decision: FailureDecision


@dataclass(frozen=True)
class End:
    """The run is over; `error` says why when it failed."""

    state: JobState
    error: str | None = None


ControllerState = Reserve | Run | Restart | End


def after_attempt(outcome: Outcome, failures: FailurePolicy, initial_workers: int) -> Restart | End:
    """What follows an attempt that ended with `outcome`."""
    match outcome:
        case Finished():
            return End(JobState.FINISHED)
        case Stopped():
            return End(JobState.STOPPED)
        case Resize(workers):
            return Restart(workers, growing=True, decision=Retry(0.0))
        case Failed():
            return Restart(initial_workers, growing=False, decision=failures.decide(outcome))


def job_state_of(state: ControllerState) -> JobState | None:
    """The job state a controller state enters (None: Run, which the runner moves to running once the
    ranks were started)."""
    match state:
        case Reserve():
            return JobState.STARTING
        case Run():
            return None
        case Restart():
            return JobState.RESTARTING
        case End(job_state):
            return job_state


class Workers(Protocol):
    """What the controller needs of the worker group (`WorkerGroup` on Ray)."""

    async def reserve(self, target: int) -> tuple[WorldPlan, Any] | None: ...

    async def teardown(self, at: Attempt) -> None: ...

    def free(self) -> int: ...

    def alive(self) -> frozenset[str]: ...


class Runs(Protocol):
    """Runs one attempt to its outcome (`AttemptRunner` on Ray)."""

    async def run(self, at: Attempt) -> Outcome: ...


class Controller:
    def __init__(
        self,
        spec: JobSpec,
        store: CheckpointStore,
        mailbox: CommandMailbox,
        metrics: MetricsHub,
        changes: Changes,
        *,
        workers: Workers | None = None,
        runner: Runs | None = None,
        launch_id: str = "",
        notice: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._spec = spec
        self._store = store
        self._mailbox = mailbox
        self._metrics = metrics
        self._changes = changes
        self._notice = notice  # says something on the console as it happens (the coordinator's notices)
        self._space_noted = False
        self.machine = StateMachine()
        self.summary = RunSummary(
            run_name=spec.run_name, status=JobState.PENDING.value, steps=0, restarts=0, launch_id=launch_id
        )
        c = spec.cluster
        self.failures = FailurePolicy(c.max_failures, c.restart_backoff_s, c.max_backoff_s)
        self._scaling = ScalingPolicy.for_job(spec)
        self._standby = StandbyPool(spec, self._standby_ready)
        group = WorkerGroup(spec, mailbox, self._scaling, self._standby, notice)
        self._workers: Workers = workers or group
        self._runner: Runs = runner or AttemptRunner(
            spec, group, mailbox, metrics, self.machine, changes, self._result, self.startup_mark
        )
        # This launch's start-up phases, up to its first step (`startup.py`); the coordinator gives it the
        # driver's marks. `_startup_attempt` is the attempt they belong to, the launch's first.
        self.startup = StartupClock(time.time())
        self._startup_attempt: int | None = None
        self.attempt: Attempt | None = None
        self.attempts = 0  # started so far
        self.latest_step: int | None = None  # of the latest committed checkpoint
        # When the first failure of the current chain was seen, until a step past the checkpoint completes.
        self._failure_time: float | None = None
        # The same recovery's phase timestamps (`recovery.py`); then, once its first step was seen, waiting
        # for the ranks' setup points before its phases go into the summary.
        self._recovery: RecoveryClock | None = None
        self._phases_pending: RecoveryClock | None = None
        # A grow decided at a commit, held until rank 0 has reported that step: the teardown would otherwise
        # drop the step's metric points still queued on the ranks (the new ranks resume after it).
        self._grow_after: tuple[int, int] | None = None  # (workers, committed step)

    # == the loop ========================================================================================

    async def run(self) -> JobState:
        try:
            state = await self._enter(self._reserve_or_stop(self._spec.initial_workers, growing=False))
            while not isinstance(state, End):
                state = await self._enter(await self._step(state))
            if state.error is not None:
                self.summary.error = state.error
            await self.teardown()
            return state.state
        finally:
            await self._standby.close()

    async def _enter(self, state: ControllerState) -> ControllerState:
        entered = job_state_of(state)
        if entered is not None and not entered.terminal:  # `finish` enters the terminal one
            self.machine.to(entered)
            await self._changes.notify()
        return state

    def _reserve_or_stop(self, target: int, *, growing: bool) -> Reserve | End:
        return End(JobState.STOPPED) if self._mailbox.stop else Reserve(target, growing)

    async def _step(self, state: ControllerState) -> ControllerState:
        match state:
            case Reserve():
                return await self._reserve(state)
            case Run(attempt):
                outcome = await self._runner.run(attempt)
                if isinstance(outcome, Failed):
                    # Say so before the teardown, which waits for Ray to release the dead actors (seconds
                    # after a node loss). A failure while recovering from another one continues the same
                    # recovery: it is measured from the first failure of the chain.
                    if self._failure_time is None:
                        self._failure_time = time.monotonic()
                    self._failure_detected(attempt)
                    _log.warning("run %s attempt failed: %s", self._spec.run_name, outcome.reason)
                return after_attempt(outcome, self.failures, self._spec.initial_workers)
            case Restart():
                return await self._restart(state)
            case End():
                return state

    async def _reserve(self, state: Reserve) -> Run | End:
        try:
            reserved = await self._workers.reserve(state.target)
        except NoResources as e:
            # A property of the request and the cluster, said in one line; the traceback is no news.
            _log.debug("run %s: placement failed", self._spec.run_name, exc_info=True)
            return End(JobState.FAILED, str(e))
        if reserved is None:
            return End(JobState.STOPPED)
        plan, pg = reserved
        # Current from here on, so that every way out (the store failing to prepare included) tears it down
        # and gives the placement group back.
        at = self.attempt = Attempt(self.attempts, plan, pg, 0, Liveness(plan.world_size))
        if self._startup_attempt is None:
            self._startup_attempt = at.index
        if state.growing:
            self._scaling.resize_reserved(state.target, plan.world_size, self._workers.alive())
        at.resumed_from = await asyncio.to_thread(self._prepare_store)
        if self.failures.no_space_seen and not self._space_noted and self._notice is not None:
            self._space_noted = True
            await self._notice(f"no space left on the device: {await asyncio.to_thread(self._freed)}")
        self.summary.standby_ranks_used.append(len(pg.standbys) if isinstance(pg, Reservation) else 0)
        self.startup_mark(at.index, "place")
        if self._recovery is not None:
            self._recovery.placed = time.time()
            self._recovery.metrics_seq = self._metrics.seq
            self._recovery.world_size = plan.world_size
        await self._started(at)
        return Run(self.attempt)

    async def _restart(self, state: Restart) -> Reserve | End:
        await self.teardown()
        if self._recovery is not None:
            self._recovery.torn_down = time.time()
        if state.growing:
            self.summary.resizes += 1
        match state.decision:
            case GiveUp(error):
                return End(JobState.FAILED, error)
            case Retry(backoff_s):
                if backoff_s > 0:
                    await self._changes.wait_until(lambda: self._mailbox.stop, backoff_s)
                if self._recovery is not None:
                    self._recovery.reserving = time.time()
                return self._reserve_or_stop(state.target, growing=state.growing)

    # == start-up and recovery phases, warm standbys =====================================================

    def startup_mark(self, attempt: int, phase: str, at: float | None = None) -> None:
        """A start-up phase of the launch's first attempt ended (later attempts' are a recovery's)."""
        if attempt == self._startup_attempt and not self.startup.done:
            self.startup.end(phase, at)
            if self.startup.done:
                self.summary.startup_s = self.startup.phases()

    def _failure_detected(self, at: Attempt) -> None:
        now = time.time()
        if self._recovery is None:
            self._flush_phases()  # the previous recovery's rank points had time enough
            detect = detect_seconds(at.live.heartbeats, time.monotonic())
            self._recovery = RecoveryClock(detected=now, detect_s=detect)
        else:
            self._recovery.failed_again(now)

    def _recovered(self) -> None:
        """The first step after a failure was seen: its phases wait for the ranks' setup points."""
        clock = self._recovery
        if clock is None:
            return
        clock.first_step = time.time()
        self._recovery = None
        self._phases_pending = clock
        self._collect_phases()

    def _collect_phases(self) -> None:
        clock = self._phases_pending
        if clock is None:
            return
        clock.note_points(self._metrics.since(clock.metrics_seq))
        clock.metrics_seq = self._metrics.seq
        if clock.complete:
            self._flush_phases()

    def _flush_phases(self) -> None:
        """Record the pending recovery's phases with what arrived (a rank's missing point gives its phases
        to the next known one)."""
        clock, self._phases_pending = self._phases_pending, None
        if clock is not None:
            clock.note_points(self._metrics.since(clock.metrics_seq))
            self.summary.recovery_phases_s.append({k: round(v, 4) for k, v in clock.phases().items()})

    @property
    def standby_ready(self) -> int:
        return self._standby.ready_count

    async def _standby_ready(self, standby: Standby) -> None:
        self.summary.standby_pids.append(standby.ready.pid)
        ready = {"standby_ranks_ready": float(self._standby.ready_count)}
        self._metrics.add(MetricPoint(self._metrics.last_step, CLUSTER_RANK, ready, "health", time.time()))
        await self._changes.notify()

    def _freed(self) -> str:
        root = self._spec.checkpoint_dir
        said = f"the uncommitted checkpoint steps under {root} were removed; retrying once"
        if isinstance(root, Path):
            with contextlib.suppress(OSError):
                return f"{said} ({shutil.disk_usage(root).free / 2**30:.2f} GiB free there now)"
        return said

    def _prepare_store(self) -> int:
        self._store.clear_uncommitted()
        latest = self._store.latest()
        return latest.step if latest is not None else 0

    async def _started(self, at: Attempt) -> None:
        self.attempts += 1
        self.summary.world_sizes.append(at.plan.world_size)
        self.summary.resumed_from.append(at.resumed_from or None)
        self.latest_step = at.resumed_from or None
        self._metrics.restart_from(at.resumed_from)
        layout: dict[str, float] = {"world_size": at.plan.world_size, "data_parallel": at.plan.data_parallel}
        self._metrics.add(MetricPoint(at.resumed_from, CLUSTER_RANK, layout, "health", time.time()))
        if at.resumed_from:
            await self._announce_resume(at)
        await self._changes.notify()

    async def _announce_resume(self, at: Attempt) -> None:
        """An attempt starts from a commit: say so on the console (and in the summary's notices), and mark it
        in the tracker and the history at the first step it trains (`system/cluster/resumed_from`: the
        commit's step; `system/cluster/restart`: 1 for a restart of this launch after a failure or for a
        resize, 0 for a launch resuming the run), where `d9d plot` draws it."""
        restart = at.index != self._startup_attempt
        step_dir = self._spec.checkpoint_dir / step_dir_name(at.resumed_from)
        what = f"attempt {at.index} restarts" if restart else f"run {self._spec.run_name} resumes"
        if self._notice is not None:
            await self._notice(f"{what} from step {at.resumed_from} (checkpoint {step_dir})")
        values = {"resumed_from": float(at.resumed_from), "restart": 1.0 if restart else 0.0}
        self._metrics.add(MetricPoint(at.resumed_from + 1, CLUSTER_RANK, values, "health", time.time()))

    async def teardown(self) -> None:
        # The attempt stays current until its ranks are gone: points and step boundaries still in flight
        # from them (a rank 0 that just committed before a resize) are accepted meanwhile.
        at = self.attempt
        self._grow_after = None  # a grow belongs to the attempt it was decided in
        if at is not None:
            try:
                await self._workers.teardown(at)
            finally:
                self.attempt = None

    def record_start(self) -> None:
        """Record the launch before anything runs: if the driver and this coordinator die together (the
        driver is killed), the run directory still tells that the launch happened and never ended."""
        self.summary.status = JobState.STARTING.value
        record_launch(self._spec.storage_root, self.summary)

    def finish(self, state: JobState) -> RunSummary:
        """Enter the terminal state and write `run_summary.json`."""
        if not self.machine.state.terminal:
            self.machine.to(state)
        self._flush_phases()
        s = self.summary
        if not s.startup_s and self._startup_attempt is not None:  # ended before its first step
            s.startup_s = self.startup.phases()
        s.status = self.machine.state.value
        s.steps = self._metrics.last_step
        s.restarts = max(self.attempts - 1, 0)
        s.failures = list(self.failures.failures)
        s.losses = dict(sorted(self._metrics.losses.items()))
        s.final_loss = s.losses[max(s.losses)] if s.losses else None
        s.ended_at = time.time()
        record_launch(self._spec.storage_root, s)
        return s

    # == what the ranks report ===========================================================================

    def current(self, attempt: int) -> Attempt | None:
        at = self.attempt
        return at if at is not None and at.index == attempt else None

    def step_seen(self, step: int) -> None:
        """A step completed; the first one past the checkpoint after a failure ends the recovery."""
        self._metrics.step_seen(step)
        self._grow_when_reported()
        self._collect_phases()
        at = self.attempt
        if at is None or at.live.step_done or step <= at.resumed_from:
            return
        at.live.step_done = True
        self.startup_mark(at.index, "first_step")
        self._standby.refill(at.sites)  # after the first step: starting standbys never slows a (re)start down
        if self._failure_time is not None:
            self._recovered()
            recovery = time.monotonic() - self._failure_time
            self._failure_time = None
            self.summary.recovery_times_s.append(recovery)
            point = MetricPoint(step, CLUSTER_RANK, {"recovery_time_s": recovery}, "health", time.time())
            self._metrics.add(point)

    def committed(self, at: Attempt, step: int) -> None:
        """At a commit boundary, restart bigger if the cluster now has room for a larger valid layout."""
        self.latest_step = step
        if at is not self.attempt:
            # The commit of an attempt torn down while its commit thread ran (a resize decided at an earlier
            # commit): growing from that attempt's size would restart the new, already larger attempt.
            return
        at.live.progress = time.monotonic()
        if not self._scaling.may_grow(at.plan.world_size):
            return  # without asking Ray
        workers = self._scaling.grow_to(at.plan.world_size, self._workers.free(), self._workers.alive())
        if workers is not None:
            self._grow_after = (workers, step)
            self._grow_when_reported()

    def _grow_when_reported(self) -> None:
        """Resize once rank 0's report of the commit step arrived: the restart resumes after that step and
        never reports it again. A step whose loss is logged waits for that loss itself: calls to the
        (asynchronous) coordinator actor may run out of order, so a later step's boundary does not prove the
        loss has arrived (under load a resize lost it). A step without a logged loss waits for the next
        boundary."""
        if self._grow_after is None:
            return
        workers, step = self._grow_after
        train = self._spec.train
        logged = reports_train_metrics(step, train.logging.period, train.trainer.total_steps)
        if step in self._metrics.losses if logged else self._metrics.last_step > step:
            self._mailbox.request_resize(workers)
            self._grow_after = None

    def resumed(self) -> None:
        if self.machine.state is JobState.PAUSED:
            self.machine.to(JobState.RUNNING)
        if self.attempt is not None:
            self.attempt.live.progress = time.monotonic()

    def ranks_paused(self) -> None:
        """Rank 0 stopped at a step boundary; a resume sent meanwhile wins (the ranks go on at once)."""
        if self._mailbox.paused and self.machine.state is JobState.RUNNING:
            self.machine.to(JobState.PAUSED)

    def _result(self, final: RankResult) -> None:
        self.summary.tokens_per_s = final.tokens_per_s
        self.step_seen(final.steps)
        self._metrics.final_loss(final.steps, final.final_loss)
