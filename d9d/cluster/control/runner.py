"""Runs one attempt: start the ranks, let them train, and watch until they return or something ends it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from d9d.cluster.control.failure import (
    SETUP_ERRORS,
    NonRetryableError,
    RankError,
    blame,
    is_no_space,
    is_retryable,
    tail,
)
from d9d.cluster.control.hang import attribute, render
from d9d.cluster.control.health import Limits, first_failure
from d9d.cluster.control.mailbox import CommandMailbox
from d9d.cluster.control.metrics import MetricsHub
from d9d.cluster.control.outcome import Failed, Finished, Outcome, Resize, Stopped
from d9d.cluster.control.signal import Changes
from d9d.cluster.control.workers import Attempt, WorkerGroup
from d9d.cluster.spec import JobSpec
from d9d.cluster.state import JobState, StateMachine
from d9d.core.files import atomic_write_text
from d9d.core.flight_recorder import Snapshot
from d9d.engine.runtime import Command, CommandKind, RankResult, failed_step

_POLL_S = 0.1
_log = logging.getLogger(__name__)


def _cause(error: BaseException) -> BaseException:
    """The rank's own exception inside Ray's `RayTaskError` (the error itself otherwise)."""
    cause = getattr(error, "cause", None) if isinstance(error, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else error


def describe(error: BaseException) -> str:
    """One line: the error's type (the rank's own, not Ray's wrapper) and the last line of its message."""
    error = _cause(error)
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"


def describe_chain(error: BaseException) -> str:
    """The exception chain's last lines with files and lines. A rank's error arrives as Ray's
    `RayTaskError`, whose text is the rank's own formatted traceback (causes and contexts included); the
    driver-side frames of re-raising it would say nothing."""
    if isinstance(error, RayTaskError):
        return tail(str(error))
    return tail("".join(traceback.format_exception(error)))


def failed(where: str, error: BaseException, *, before_first_step: bool) -> Failed:
    return Failed(
        f"{where}: {describe(error)}",
        retryable=is_retryable(error, before_first_step=before_first_step),
        detail=describe_chain(error),
    )


def rank_error(rank: int, error: BaseException, seen_at: float) -> RankError:
    """What a rank's failed `run` call says, as a `RankError` (its process died: `died`)."""
    if isinstance(error, RayActorError):
        return RankError(
            rank, type(error).__name__, str(error).strip(), tail(str(error)), died=True, seen_at=seen_at
        )
    cause = _cause(error)
    text = str(error) if isinstance(error, RayTaskError) else ""
    found = RankError.of(rank, cause, step=failed_step(cause), text=text)
    # Ray's wrapper derives from the rank's class, so the retry checks see the rank's type either way.
    return dataclasses.replace(
        found,
        non_retryable=found.non_retryable or isinstance(error, NonRetryableError),
        setup_error=found.setup_error or isinstance(error, SETUP_ERRORS),
        no_space=found.no_space or is_no_space(error),
        seen_at=seen_at,
    )


def attempt_errors(reported: list[RankError], crashed: dict[int, RankError]) -> list[RankError]:
    """The errors of one attempt in the order they arrived: what ranks reported, and the failed `run` calls
    of ranks that reported nothing (a rank's report and its call's error are the same exception)."""
    ranks = {e.rank for e in reported}
    errors = [*reported, *(e for r, e in crashed.items() if r not in ranks)]
    return sorted(errors, key=lambda e: e.seen_at)


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
    # (attempt, start-up phase) as each ends here: "actors", "tracker" (d9d.cluster.control.startup)
    on_phase: Callable[[int, str], None] = lambda attempt, phase: None

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
        self.on_phase(at.index, "actors")
        # Opening a tracker (an MLflow store) can take longer than starting the ranks; training begins
        # only once metric points can be written as they arrive.
        await asyncio.to_thread(self.metrics.wait_ready, self.spec.init_timeout_s)
        self.on_phase(at.index, "tracker")
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
        crashed: dict[int, RankError] = {}  # ranks whose `run` call failed
        pending = set(runs)
        while True:
            done, pending = await asyncio.wait(pending, timeout=_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            now = time.monotonic()
            for fut in done:
                rank = runs[fut]
                error = fut.exception()
                if error is None:
                    results[rank] = fut.result()
                else:
                    crashed[rank] = rank_error(rank, error, now)
            errors = attempt_errors(at.live.errors, crashed)
            if errors:
                # The first rank's own exception; a broken collective only when nothing better came.
                blamed = blame(errors, now=now, all_done=not pending)
                if blamed is not None:
                    return blamed.outcome(before_first_step=not at.live.step_done)
                if self.mailbox.kill:
                    return Stopped("killed by request")
                continue  # within the grace for the error that broke the collectives
            if not pending:
                final = results[0]
                self.on_result(final)
                return Finished() if final.status == "finished" else Stopped()
            outcome = self._interrupted(at, results)
            if isinstance(outcome, Failed) and outcome.hung:
                return await self._explain_hang(at, outcome)
            if outcome is not None:
                return outcome

    async def _explain_hang(self, at: Attempt, failure: Failed) -> Failed:
        """Before the hung ranks are torn down: every rank's stacks and last collectives, who is behind and
        where — in the failure's reason (the console, `d9d status`, the summary) and in
        `<run dir>/hang-attempt<N>.txt`."""
        try:
            dumps = await self.workers.dump_ranks(at)
        except Exception as e:  # no explanation is no reason to keep the hung ranks
            _log.warning("run %s: could not collect the ranks' stacks: %s", self.spec.run_name, e)
            return failure
        stacks = {r: d.stacks for r, d in dumps.items()}
        collectives = {r: _snapshot(d.collectives) for r, d in dumps.items()}
        report = attribute(stacks, at.plan.world_size, at.live.returned, collectives)
        path = self.spec.run_dir / f"hang-attempt{at.index}.txt"
        text = render(report, stacks, failure.reason, collectives)
        try:
            await asyncio.to_thread(atomic_write_text, path, text)
        except OSError as e:
            _log.warning("run %s: cannot write %s: %s", self.spec.run_name, path, e)
        detail = "\n".join(f"rank {r}: {line}" for r, line in sorted(report.positions.items()))
        if report.collectives is not None:
            detail += "\n" + "\n".join(
                f"rank {r} collectives: {line}" for r, line in sorted(report.collectives.ranks.items())
            )
        return dataclasses.replace(
            failure,
            reason=f"{failure.reason}; {report.summary} (all stacks: {path})",
            detail=f"{failure.detail}\n{detail}".strip(),
        )

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


def _snapshot(text: str) -> Snapshot | None:
    """A rank's flight-recorder snapshot (JSON text from its node's dump task); None when unreadable."""
    try:
        return Snapshot.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        _log.warning("unreadable flight-recorder snapshot: %s", e)
        return None
