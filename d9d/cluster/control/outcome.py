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
    failure list); `detail` the exception chain's last lines with their files, for the final error.

    `step` is the training step a rank raised in (None: not known, or not an exception) and `key` what
    makes two exceptions the same (type and message): the same key at the same step after a restart is
    not retried again (`FailurePolicy`)."""

    reason: str
    retryable: bool = True
    detail: str = ""
    step: int | None = None
    key: str = ""
    no_space: bool = False  # ENOSPC: retried once (the restart frees the uncommitted steps), then fatal
    hung: bool = False  # a health check declared ranks hung: their stacks are collected before the teardown


@dataclass(frozen=True)
class Resize:
    """The attempt was ended at a commit to start again with `workers` ranks (the cluster grew)."""

    workers: int


Outcome = Finished | Stopped | Failed | Resize
