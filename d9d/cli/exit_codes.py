"""Exit statuses of `d9d train` and `d9d resume`, for schedulers and scripts (docs/cluster.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from d9d.cluster.client import TrainingJob
    from d9d.cluster.state import RunSummary

FINISHED = 0  # trained to the last step, or stopped on request (`d9d stop`, `TrainingJob.stop`)
FAILED = 1  # the run failed; its error (the first failing rank's exception) was printed
REFUSED = 2  # nothing started: a config or preflight error, a resume refused
COORDINATOR_LOST = 3  # the coordinator died under the driver; `d9d resume RUN` continues the run
LIVE_LAUNCH = 4  # another launch of this run is live (its lease is fresh); nothing started
ALREADY_FINISHED = 5  # the run's newest commit is its last step; nothing to train
# SIGTERM/SIGINT to the driver, or Ray draining a rank's node (a preemption): the ranks stopped at a step
# boundary and committed it; `d9d resume RUN` continues. EX_TEMPFAIL of sysexits.h: "try again later".
PREEMPTED = 75
PREEMPTED_REASON = "preempted"  # how a preempted run's `stop_reason` starts


def of_run(job: TrainingJob, summary: RunSummary) -> int:
    """The exit status of a driver that followed `job` to its end."""
    if job.coordinator_lost:
        return COORDINATOR_LOST
    if preempted(summary):
        return PREEMPTED
    return FAILED if summary.status == "failed" else FINISHED


def preempted(summary: RunSummary) -> bool:
    """The run stopped because its place went away (the coordinator stopped it on a node drain)."""
    return summary.status == "stopped" and (summary.stop_reason or "").startswith(PREEMPTED_REASON)
