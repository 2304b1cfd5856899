"""Whether a failed attempt is tried again, and after how long.

`FailurePolicy` holds the failure history of a run and answers each new failure with a `FailureDecision`:
`Retry` after an exponential backoff while the budget (`cluster.max_failures`) lasts, `GiveUp` when it is
spent, the failure is not retryable, or the same exception recurred at the same step after a restart.

`RankError` is a rank's exception as plain data (the rank reports it before it tears its process group
down, so it reaches the coordinator before any peer's broken collective); `blame` picks, of the errors of
ranks that failed together, the one that names the attempt's failure.
"""

from __future__ import annotations

import errno
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

from d9d.cluster.control.outcome import Failed
from d9d.engine.nonfinite import NonFiniteError

# Lines of a rank's traceback kept in the run's error (the rank's log file has all of it).
TRACEBACK_LINES = 40


class NonRetryableError(RuntimeError):
    """Raise it on a rank for an error that running the attempt again would only repeat: the run then
    ends as failed at once instead of spending its restart budget."""


# Errors that a rank raising them before its first step would raise again on every attempt: a config or
# shape problem (ValueError, which ConfigError and the state mapping errors are), a missing or unreadable
# file, a module or name that does not import, a provider of the wrong type. A process that died, a broken
# collective or a timeout (RuntimeError, OSError in general, Ray's own errors) stays retryable.
SETUP_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    LookupError,
    TypeError,
    AttributeError,
    ImportError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


def is_retryable(error: BaseException, *, before_first_step: bool = False) -> bool:
    """Whether an attempt that ended with `error` on a rank may succeed when run again.

    `NonRetryableError` and the engine's `NonFiniteError` never are. Before the attempt's first step
    completed, a `SETUP_ERRORS` error is not either: setup is deterministic, so the next attempt would
    fail the same way (after a step, the same error may come from a transient state and the restart
    budget decides).

    Ray re-raises a rank's exception as a subclass of both its own error type and the original class, so
    the check sees the rank's type."""
    if isinstance(error, (NonRetryableError, NonFiniteError)):
        return False  # a non-finite step comes back when the same data meets the same weights
    return not (before_first_step and isinstance(error, SETUP_ERRORS))


# What a collective that broke because a peer went away says (gloo, NCCL, the c10d store): such an error is
# most likely a consequence of another rank's failure, and names the attempt's failure only when nothing
# better arrives (`blame`).
_COLLECTIVE_TYPES = frozenset({"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"})
_COLLECTIVE_TEXT = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "[gloo]",
    "gloo/transport",
    "nccl",
    "processgroup",
    "socket timeout",
    "timed out in",
)


def is_collective_error(error: BaseException) -> bool:
    """Whether `error` is a broken collective or rendezvous (see `_COLLECTIVE_TEXT`)."""
    if any(t.__name__ in _COLLECTIVE_TYPES for t in type(error).__mro__):
        return True
    text = str(error).lower()
    return any(marker in text for marker in _COLLECTIVE_TEXT)


def is_no_space(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) says the device is full (ENOSPC)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


@dataclass(frozen=True)
class RankError:
    """One rank's failure as plain data: its exception (`died`: the process itself went away)."""

    rank: int
    type: str  # the exception class's name
    message: str
    traceback: str = ""  # the chain's last `TRACEBACK_LINES` lines
    step: int | None = None  # the training step it raised in, when the engine said (`failed_step`)
    collective: bool = False  # a broken collective: probably a consequence of another rank's failure
    non_retryable: bool = False  # a NonRetryableError
    setup_error: bool = False  # one of SETUP_ERRORS
    no_space: bool = False  # the device is full (ENOSPC)
    died: bool = False
    log: str = ""  # the rank's log file, which holds the whole traceback
    seen_at: float = 0.0  # monotonic, on the coordinator: when it arrived

    @classmethod
    def of(cls, rank: int, error: BaseException, *, step: int | None = None, text: str = "") -> RankError:
        """`error` as raised on `rank` (`text`: its formatted traceback, when it is not `error`'s own)."""
        text = text or "".join(traceback.format_exception(error))
        return cls(
            rank=rank,
            type=type(error).__name__,
            message=str(error).strip(),
            traceback=tail(text),
            step=step,
            collective=is_collective_error(error),
            non_retryable=isinstance(error, NonRetryableError),
            setup_error=isinstance(error, SETUP_ERRORS),
            no_space=is_no_space(error),
        )

    @property
    def headline(self) -> str:
        """`rank 1: ValueError: <the message's last line>` (or that the process died)."""
        lines = self.message.splitlines()
        last = lines[-1] if lines else ""
        if self.died:
            return f"rank {self.rank}: process died: {last}".rstrip(": ")
        return f"rank {self.rank}: {self.type}: {last}"

    def outcome(self, *, before_first_step: bool) -> Failed:
        retryable = not self.non_retryable and not (before_first_step and self.setup_error)
        reason = self.headline if self.step is None else f"{self.headline} (step {self.step})"
        key = "" if self.died or self.collective else f"{self.type}: {self.message}"
        detail = f"{self.traceback}\n(rank {self.rank}'s log: {self.log})" if self.log else self.traceback
        return Failed(
            reason, retryable=retryable, detail=detail, step=self.step, key=key, no_space=self.no_space
        )


def tail(text: str, lines: int = TRACEBACK_LINES) -> str:
    """The last `lines` lines of `text` (a traceback), saying how many were left out."""
    all_lines = text.strip().splitlines()
    if len(all_lines) <= lines:
        return "\n".join(all_lines)
    return "\n".join([f"... ({len(all_lines) - lines} lines before)", *all_lines[-lines:]])


# How long the coordinator waits, after a rank's broken collective, for the error that broke it: the peer's
# own exception (reported before it tears its process group down) or its process's death.
SECONDARY_GRACE_S = 2.0


def blame(
    errors: Sequence[RankError], *, now: float, all_done: bool, grace_s: float = SECONDARY_GRACE_S
) -> RankError | None:
    """Which of the errors that ranks of one attempt reported (in the order they arrived) is the attempt's
    failure; None while it may still change (only broken collectives so far, within `grace_s` of the first).

    A rank's own exception comes first (the earliest), then a rank whose process died, then a broken
    collective: that is what the others see when a peer raised or died."""
    if not errors:
        return None
    own = [e for e in errors if not e.collective and not e.died]
    if own:
        return own[0]
    died = [e for e in errors if e.died]
    if died:
        return died[0]
    first = min(errors, key=lambda e: e.seen_at)
    return first if all_done or now - first.seen_at >= grace_s else None


@dataclass(frozen=True)
class Retry:
    """Start the next attempt after `backoff_s` (a stop request cuts the wait short)."""

    backoff_s: float


@dataclass(frozen=True)
class GiveUp:
    """End the run as failed; `error` goes to the run summary."""

    error: str


FailureDecision = Retry | GiveUp


@dataclass
class FailurePolicy:
    max_failures: int
    backoff_s: float
    max_backoff_s: float
    failures: list[str] = field(default_factory=list)
    # (step, key) of every exception seen at a known step: the same one again is deterministic.
    _seen: set[tuple[int, str]] = field(default_factory=set, repr=False)
    no_space_seen: bool = False  # a failure said the device was full: the restart freed what it could

    def decide(self, failure: Failed) -> FailureDecision:
        """Record `failure` and say what to do about it."""
        self.failures.append(failure.reason)
        count = len(self.failures)
        if not failure.retryable:
            return GiveUp(_with_detail(f"not retryable: {failure.reason}", failure.detail))
        if failure.no_space:
            if self.no_space_seen:
                return GiveUp(
                    _with_detail(
                        f"{failure.reason}: no space left on the device again, after a restart that freed "
                        "the uncommitted checkpoint steps; free space on the checkpoint store (or lower "
                        "checkpointing.keep_last), then `d9d resume` the run",
                        failure.detail,
                    )
                )
            self.no_space_seen = True
        if failure.step is not None and failure.key:
            seen = (failure.step, failure.key)
            if seen in self._seen:
                return GiveUp(
                    _with_detail(
                        f"{failure.reason}, again after a restart at the same step: not retried again",
                        failure.detail,
                    )
                )
            self._seen.add(seen)
        if count > self.max_failures:
            return GiveUp(
                _with_detail(
                    f"gave up after {count} failures (cluster.max_failures={self.max_failures}); "
                    f"last: {failure.reason}",
                    failure.detail,
                )
            )
        return Retry(min(self.backoff_s * 2 ** (count - 1), self.max_backoff_s))


def _with_detail(line: str, detail: str) -> str:
    return f"{line}\n{detail}" if detail else line
