"""Runs one attempt: start the ranks, let them train, and watch until they return or something ends it."""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from d9d.cluster.control.failure import is_retryable
from d9d.cluster.control.health import Limits, first_failure
from d9d.cluster.control.mailbox import CommandMailbox
from d9d.cluster.control.metrics import MetricsHub
from d9d.cluster.control.outcome import Failed, Finished, Outcome, Resize, Stopped
from d9d.cluster.control.signal import Changes
from d9d.cluster.control.workers import Attempt, WorkerGroup
from d9d.cluster.spec import JobSpec
from d9d.cluster.state import JobState, StateMachine
from d9d.engine.runtime import Command, CommandKind, RankResult

_POLL_S = 0.1


def describe(error: BaseException) -> str:
    """One line: the error's type and the last line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"


def describe_chain(error: BaseException) -> str:
    """The whole exception chain with files and lines. A rank's error arrives as Ray's `RayTaskError`,
    whose text is the rank's own formatted traceback (causes and contexts included); the driver-side
    frames of re-raising it would say nothing."""
    if isinstance(error, RayTaskError):
        return str(error).strip()
    return "".join(traceback.format_exception(error)).strip()


def failed(where: str, error: BaseException, *, before_first_step: bool) -> Failed:
    return Failed(
        f"{where}: {describe(error)}",
        retryable=is_retryable(error, before_first_step=before_first_step),
        detail=describe_chain(error),
    )


def failure_precedence(fut: asyncio.Future[Any], *, before_first_step: bool = False) -> int:
    """Which of the ranks that failed together names the attempt's failure: one whose process died (its
    peers' collectives broke because of it), then one whose error is not retryable, then any."""
    error = fut.exception()
    if isinstance(error, RayActorError):
        return 0
    if error is not None and not is_retryable(error, before_first_step=before_first_step):
        return 1
    return 2


def _consume(futures: Iterable[asyncio.Future[Any]]) -> None:
    """Mark the errors of futures the attempt no longer reads as seen: the failure was reported once, and
    asyncio would otherwise log every other rank's copy of it ("exception was never retrieved")."""
    for fut in futures:
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())


@dataclass
class AttemptRunner:
    spec: JobSpec
    workers: WorkerGroup
    mailbox: CommandMailbox
    metrics: MetricsHub
    machine: StateMachine
    changes: Changes
    on_result: Callable[[RankResult], None]  # rank 0's result of an attempt whose ranks all returned

    @property
    def limits(self) -> Limits:
        return Limits(
            self.spec.step_timeout_s, self.spec.init_timeout_s, self.spec.cluster.heartbeat_timeout_s
        )

    async def run(self, at: Attempt) -> Outcome:
        try:
            launches = await self.workers.start(at)
        except Exception as e:
            # Starting actors fails for transient reasons (a rank name the last attempt still holds, a node
            # going away): only an explicit NonRetryableError ends the run here.
            return failed("starting ranks", e, before_first_step=False)
        # Opening a tracker (an MLflow store) can take longer than starting the ranks; training begins
        # only once metric points can be written as they arrive.
        await asyncio.to_thread(self.metrics.wait_ready, self.spec.init_timeout_s)
        at.live.progress = time.monotonic()
        self.metrics.asleep = False  # a new attempt's state is on the device until its ranks sleep
        if self.mailbox.paused:  # the new rank 0 pauses (or sleeps) at its first step boundary
            self.mailbox.post(Command(CommandKind.SLEEP if self.mailbox.asleep else CommandKind.PAUSE))
        runs = {asyncio.ensure_future(a.run.remote(launch)): r for r, (a, launch) in enumerate(launches)}
        self.machine.to(JobState.RUNNING)
        await self.changes.notify()
        try:
            return await self._watch(at, runs)
        finally:
            _consume(runs)

    async def _watch(self, at: Attempt, runs: dict[asyncio.Future[Any], int]) -> Outcome:
        results: dict[int, RankResult] = {}
        pending = set(runs)
        while True:
            done, pending = await asyncio.wait(pending, timeout=_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            setup = not at.live.step_done

            def order(f: asyncio.Future[Any], setup: bool = setup) -> tuple[int, int]:
                return failure_precedence(f, before_first_step=setup), runs[f]

            for fut in sorted(done, key=order):
                rank = runs[fut]
                try:
                    results[rank] = fut.result()
                except Exception as e:
                    return failed(f"rank {rank}", e, before_first_step=setup)
            if not pending:
                final = results[0]
                self.on_result(final)
                return Finished() if final.status == "finished" else Stopped()
            outcome = self._interrupted(at, results)
            if outcome is not None:
                return outcome

    def _interrupted(self, at: Attempt, results: dict[int, RankResult]) -> Outcome | None:
        """Why a running attempt must end now: a kill, a failed health check, or a resize."""
        now = time.monotonic()
        if self.mailbox.kill:
            return Stopped("killed by request")
        live = at.live
        if results:
            live.returned = frozenset(results)
            live.first_returned = live.first_returned or now
        failure = first_failure(live, self.limits, now, self.mailbox.paused)
        if failure is not None:
            return failure
        workers = self.mailbox.take_resize()
        return Resize(workers) if workers is not None and workers != at.plan.world_size else None
