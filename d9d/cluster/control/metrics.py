"""Where every metric point of a run passes: numbered into a buffer clients read from, and written to the
tracker (once per step and stream, and each rank's setup point of every attempt, see `ReplayFilter`)."""

from __future__ import annotations

from collections import deque

from d9d.cluster.sink import MetricsWriter, ReplayFilter
from d9d.cluster.state import JobState
from d9d.engine.runtime import MetricPoint
from d9d.tracking import RunStatus

CLUSTER_RANK = -1  # metric points about the job itself (recovery time, world size) carry this rank
_BUFFER = 100_000

_TRACKER_STATUS: dict[JobState, RunStatus] = {
    JobState.FINISHED: "finished",
    JobState.STOPPED: "killed",
    JobState.FAILED: "failed",
}


def loss_step(point: MetricPoint) -> int | None:
    """The step a point completes when it is rank 0's loss: the job's progress signal."""
    if point.kind == "train" and point.rank == 0 and "loss" in point.values:
        return point.step
    return None


def reports_pause(point: MetricPoint) -> bool:
    """Rank 0 says it stopped at a step boundary on a pause command."""
    return point.kind == "health" and point.rank == 0 and "paused" in point.values


def reports_sleep(point: MetricPoint) -> bool | None:
    """Rank 0 says its training state went to host memory (True) or came back (False); None: neither."""
    if point.kind == "health" and point.rank == 0 and "asleep" in point.values:
        return point.values["asleep"] > 0
    return None


class StepOrder:
    """What one client handle delivers of the points it polls (`TrainingJob.metrics`, `poll_metrics`): each
    stream in step order and once.

    A stream is the tracker's (`ReplayFilter`): one kind of values from one rank. Its steps strictly increase:
    a step a restarted attempt trains again (already delivered by the attempt that failed) is not delivered a
    second time, as the tracker does not record it twice. Each poll's points are sorted by step first (a
    stable sort: points of one step keep their arrival order). The cluster's own events (rank -1: world size,
    resumes, recovery times) are each delivered once, at the step they concern, unfiltered: two restarts from
    one commit are two events at one step. So are the ranks' setup points, one per rank and attempt (that
    attempt's start-up timings; `ReplayFilter`): a restarted attempt's come at step 0 (rank 0's at the commit
    it resumes from), where the failed attempt's may have come, and are delivered all the same, so a rank's
    setup stream has one point per attempt. Streams are not held back for each other: a rank whose courier
    delivers later, or task metrics that a background collector finishes steps later, may come after a
    later step of another stream.
    """

    def __init__(self) -> None:
        self._replays = ReplayFilter()

    def take(self, points: list[MetricPoint]) -> list[MetricPoint]:
        ordered = sorted(points, key=lambda p: p.step)
        return [p for p in ordered if p.rank == CLUSTER_RANK or self._replays.fresh(p)]


class MetricsHub:
    def __init__(self, writer: MetricsWriter, buffer: int = _BUFFER) -> None:
        self._writer = writer
        self._replays = ReplayFilter()
        self._buffer: deque[tuple[int, MetricPoint]] = deque(maxlen=buffer)
        self.seq = 0  # of the last point buffered
        self.losses: dict[int, float] = {}  # rank 0's loss per step, as last trained
        self.last_step = 0
        self.asleep = False  # as rank 0 last reported

    def add(self, point: MetricPoint) -> None:
        step = loss_step(point)
        if step is not None:
            self.losses[step] = float(point.values["loss"])
        asleep = reports_sleep(point)
        if asleep is not None:
            self.asleep = asleep
        self.seq += 1
        self._buffer.append((self.seq, point))
        if point.rank == CLUSTER_RANK or self._replays.fresh(point):
            self._writer.submit(point)

    def since(self, seq: int) -> list[MetricPoint]:
        return [p for s, p in self._buffer if s > seq]

    def step_seen(self, step: int) -> None:
        self.last_step = max(self.last_step, step)

    def restart_from(self, step: int) -> None:
        """An attempt starts from the commit at `step` (0: from scratch). The losses of later steps came
        from an attempt that was abandoned: they are dropped, to be reported again as the steps are trained
        anew, so that neither the summary nor a grow waiting for a step's loss takes the abandoned one."""
        self.losses = {s: loss for s, loss in self.losses.items() if s <= step}

    def final_loss(self, step: int, loss: float | None) -> None:
        """Rank 0's result: the last step's loss, when no point carried it."""
        if loss is not None and step not in self.losses:
            self.losses[step] = loss

    @property
    def last_loss(self) -> float | None:
        return self.losses[max(self.losses)] if self.losses else None

    def wait_ready(self, timeout_s: float) -> bool:
        return self._writer.wait_ready(timeout_s)

    def close(self, state: JobState) -> None:
        self._writer.close(_TRACKER_STATUS.get(state, "failed"))
