"""How an attempt ended: one frozen value per kind, so each carries exactly the fields it means."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finished:
    """Every rank returned and rank 0 trained to the last step."""


@dataclass(frozen=True)
class Stopped:
    """Every rank returned early on a stop command, or the ranks were killed on request."""

    reason: str = ""


@dataclass(frozen=True)
class Failed:
    """A rank died, raised, hung or missed its heartbeats; `retryable` is False when trying again cannot
    help (see `failure.is_retryable`). `reason` is one line (logged per attempt, kept in the summary's
    failure list); `detail` the whole exception chain with its files and lines, for the final error."""

    reason: str
    retryable: bool = True
    detail: str = ""


@dataclass(frozen=True)
class Resize:
    """The attempt was ended at a commit to start again with `workers` ranks (the cluster grew)."""

    workers: int


Outcome = Finished | Stopped | Failed | Resize
