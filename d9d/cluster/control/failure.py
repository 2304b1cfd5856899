"""Whether a failed attempt is tried again, and after how long.

`FailurePolicy` holds the failure history of a run and answers each new failure with a `FailureDecision`:
`Retry` after an exponential backoff while the budget (`cluster.max_failures`) lasts, `GiveUp` when it is
spent or the failure is not retryable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from d9d.cluster.control.outcome import Failed


class NonRetryableError(RuntimeError):
    """Raise it on a rank for an error that running the attempt again would only repeat: the run then
    ends as failed at once instead of spending its restart budget."""


def is_retryable(error: BaseException) -> bool:
    """Whether an attempt that ended with `error` on a rank may succeed when run again.

    Ray re-raises a rank's exception as a subclass of both its own error type and the original class, so
    the check sees the rank's type."""
    return not isinstance(error, NonRetryableError)


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
            return GiveUp(f"not retryable: {failure.reason}")
        if count > self.max_failures:
            return GiveUp(
                f"gave up after {count} failures (cluster.max_failures={self.max_failures}); "
                f"last: {failure.reason}"
            )
        return Retry(min(self.backoff_s * 2 ** (count - 1), self.max_backoff_s))
