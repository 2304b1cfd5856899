"""Whether a failed attempt is tried again, and after how long.

`FailurePolicy` holds the failure history of a run and answers each new failure with a `FailureDecision`:
`Retry` after an exponential backoff while the budget (`cluster.max_failures`) lasts, `GiveUp` when it is
spent or the failure is not retryable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from d9d.cluster.control.outcome import Failed
from d9d.engine.nonfinite import NonFiniteError


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

    def decide(self, failure: Failed) -> FailureDecision:
        """Record `failure` and say what to do about it."""
        self.failures.append(failure.reason)
        count = len(self.failures)
        if not failure.retryable:
            return GiveUp(_with_detail(f"not retryable: {failure.reason}", failure.detail))
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
