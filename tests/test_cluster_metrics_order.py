"""`TrainingJob.metrics()` delivers each stream of a run in step order, each step once: the rank's courier
keeps one call of points in flight (the asynchronous coordinator would run two out of order), and the
handle sorts what it polls and leaves out the steps a restarted attempt trains again."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from d9d.cluster import TrainingJob
from d9d.cluster import client as client_module
from d9d.cluster import reporter as reporter_module
from d9d.cluster.control.metrics import MetricsHub
from d9d.cluster.rank import SETUP_BUILD, SETUP_LOAD, SETUP_PROCESS_GROUP, is_setup_point
from d9d.cluster.spec import build_job
from d9d.engine.runtime import MetricPoint
from tests.cluster_fixtures import toy_job

pytestmark = pytest.mark.timeout(120)


def _train(step: int) -> MetricPoint:
    return MetricPoint(step, 0, {"loss": float(step)}, "train", 0.0)


def _health(step: int, rank: int) -> MetricPoint:
    return MetricPoint(step, rank, {"step_time_s": 0.1}, "health", 0.0)


def _cluster(step: int, world: float) -> MetricPoint:
    return MetricPoint(step, -1, {"world_size": world}, "health", 0.0)


def _setup(step: int, rank: int, attempt: int) -> MetricPoint:
    """A rank's setup point (`PhasedReporter`): rank 0's at its first step boundary (the step it resumes
    from), the others' at step 0; the wall time tells the attempts apart."""
    values = {SETUP_PROCESS_GROUP: 0.5, SETUP_BUILD: 1.0 + attempt}
    if rank == 0:
        values[SETUP_LOAD] = 0.25
    return MetricPoint(step, rank, values, "health", 100.0 * (attempt + 1) + rank)


def _two_restarts() -> list[tuple[list[MetricPoint], bool]]:
    """Attempt 0 reaches step 3; attempt 1 restarts from scratch (no commit yet) and reaches step 4, attempt
    2 from the commit at step 2 and ends at step 5. Each attempt's two ranks report their setup point once."""
    return [
        ([_cluster(0, 2.0), _setup(0, 0, 0), _setup(0, 1, 0), _train(1), _health(1, 1), _train(2)], False),
        ([_health(2, 1), _train(3)], False),
        ([_cluster(0, 2.0), _setup(0, 1, 1), _setup(0, 0, 1), _train(1), _health(1, 1), _train(2)], False),
        ([_train(3), _train(4)], False),
        ([_cluster(2, 2.0), _setup(0, 1, 2), _setup(2, 0, 2), _train(3), _health(3, 1), _train(5)], True),
    ]


# (rank, step, wall time) of every setup point `_two_restarts` reports, in order: all three attempts'.
EVERY_ATTEMPTS_SETUPS = [
    (0, 0, 100.0),
    (1, 0, 101.0),
    (1, 0, 201.0),
    (0, 0, 200.0),
    (1, 0, 301.0),
    (0, 2, 300.0),
]


def _setups(points: list[MetricPoint]) -> list[tuple[int, int, float]]:
    return [(p.rank, p.step, p.wall_time) for p in points if SETUP_PROCESS_GROUP in p.values]


# -- the courier ---------------------------------------------------------------------------------------------


class _Call:
    def __init__(self, method: str, args: tuple[Any, ...]) -> None:
        self.method, self.args, self.ran = method, args, False


class _ReorderingCoordinator:
    """Runs the calls pending at a `flush` newest first, as Ray runs a small call on an asynchronous actor
    before an earlier one whose large arguments are still coming through the object store."""

    def __init__(self) -> None:
        self.pending: list[_Call] = []
        self.arrived: list[int] = []  # the steps of the points, in the order they arrived

    def __getattr__(self, name: str) -> Any:
        coordinator = self

        class _Method:
            @staticmethod
            def remote(*args: Any) -> _Call:
                call = _Call(name, args)
                if name in ("boundary", "report", "commit"):
                    coordinator.pending.append(call)
                else:
                    call.ran = True
                return call

        return _Method()

    def run(self, call: _Call) -> None:
        if not call.ran:
            call.ran = True
            points = {"boundary": call.args[-1], "report": call.args[-1], "commit": call.args[-1]}
            self.arrived.extend(p.step for p in points[call.method])
            self.pending.remove(call)

    def flush(self) -> None:
        for call in reversed(list(self.pending)):
            self.run(call)


def test_the_courier_delivers_a_ranks_points_in_the_order_they_were_reported(monkeypatch) -> None:
    coordinator = _ReorderingCoordinator()

    def get(call: _Call) -> None:
        coordinator.run(call)

    def wait(refs: list[_Call], **_: Any) -> tuple[list[_Call], list[_Call]]:
        return [r for r in refs if r.ran], [r for r in refs if not r.ran]

    monkeypatch.setattr(reporter_module.ray, "get", get)
    monkeypatch.setattr(reporter_module.ray, "wait", wait)
    rank0 = reporter_module.RayRunReporter(coordinator, attempt=0, rank=0, command_seq=0, transfer=None)

    sent: int | None = None
    for step in range(1, 13):
        rank0.metrics(_train(step))
        rank0._step = step  # the step boundary (`commands` would also start the command listener)
        sent = rank0._send(last_step=sent)  # a courier tick
        if step % 3 == 0:
            coordinator.flush()
    rank0.close()

    assert coordinator.arrived == list(range(1, 13))


# -- the client handle ---------------------------------------------------------------------------------------


class _Coordinator:
    """`metrics_since` answers from a script of polls: (points, ended)."""

    def __init__(self, polls: list[tuple[list[MetricPoint], bool]]) -> None:
        self.polls = polls
        self.seq = 0

    @property
    def metrics_since(self) -> Any:
        coordinator = self

        class _Call:
            @staticmethod
            def remote(seq: int, wait_s: float) -> tuple[int, list[MetricPoint], bool]:
                assert seq == coordinator.seq, "the handle asked again for points it was given"
                points, ended = coordinator.polls.pop(0) if coordinator.polls else ([], True)
                coordinator.seq += len(points)
                return coordinator.seq, points, ended

        return _Call()


def _handle(polls: list[tuple[list[MetricPoint], bool]], tmp_path: Path) -> TrainingJob:
    job = TrainingJob(build_job(toy_job("order", tmp_path)))
    job._handle = _Coordinator(polls)
    return job


def test_metrics_deliver_each_stream_in_step_order_and_each_step_once(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(client_module.ray, "get", lambda answer: answer)
    polls = [
        # rank 1's courier delivered its points late and out of order; rank 0's train/health at step 3
        ([_health(2, 1), _train(3), _health(3, 0), _health(1, 1), _train(1), _train(2)], False),
        # a restart from the commit at step 2: the cluster's event, then steps 3 and 4 trained (again)
        ([_cluster(2, 2.0), _train(3), _health(3, 0), _train(4), _health(3, 1), _health(4, 0)], False),
        # a second restart from the same commit is a second event at the same step
        ([_cluster(2, 2.0), _train(3), _train(4), _train(5)], True),
    ]
    job = _handle(polls, tmp_path)

    got = [(p.kind, p.rank, p.step) for p in job.metrics(timeout=5)]

    assert got == [
        ("health", 1, 1),
        ("train", 0, 1),
        ("health", 1, 2),
        ("train", 0, 2),
        ("train", 0, 3),
        ("health", 0, 3),
        ("health", -1, 2),
        ("health", 1, 3),
        ("train", 0, 4),
        ("health", 0, 4),
        ("health", -1, 2),
        ("train", 0, 5),
    ]
    streams: dict[tuple[str, int], list[int]] = {}
    for kind, rank, step in got:
        if rank >= 0:
            streams.setdefault((kind, rank), []).append(step)
    assert all(steps == sorted(set(steps)) for steps in streams.values()), streams


def test_a_poll_of_replays_only_does_not_end_the_metrics_early(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(client_module.ray, "get", lambda answer: answer)
    polls = [([_train(1), _train(2)], False), ([_train(2)], True), ([_train(3)], True)]
    job = _handle(polls, tmp_path)
    assert [p.step for p in job.metrics(timeout=5)] == [1, 2, 3]


def test_a_restarted_attempts_setup_points_are_delivered_and_its_replayed_steps_are_not(
    monkeypatch, tmp_path: Path
) -> None:
    """A restarted attempt's setup points (its own start-up's timings) arrive at a step the failed
    attempt's did too (step 0; rank 0's at the commit it resumes from, 0 without one): they are not
    replays, and a user reading setup timings after a fault gets every attempt's."""
    monkeypatch.setattr(client_module.ray, "get", lambda answer: answer)
    job = _handle(_two_restarts(), tmp_path)

    got = list(job.metrics(timeout=5))

    assert _setups(got) == EVERY_ATTEMPTS_SETUPS
    assert [p.step for p in got if p.kind == "train"] == [1, 2, 3, 4, 5]
    assert [p.step for p in got if p.kind == "health" and p.rank == 1 and "step_time_s" in p.values] == [
        1,
        2,
        3,
    ]


class _Writer:
    def __init__(self) -> None:
        self.points: list[MetricPoint] = []

    def submit(self, point: MetricPoint) -> None:
        self.points.append(point)


def test_the_tracker_gets_every_attempts_setup_points_and_each_trained_step_once() -> None:
    writer = _Writer()
    hub = MetricsHub(writer)  # type: ignore[arg-type]  # only `submit` is called
    for points, _ in _two_restarts():
        for point in points:
            hub.add(point)

    assert _setups(writer.points) == EVERY_ATTEMPTS_SETUPS
    assert [p.step for p in writer.points if p.kind == "train"] == [1, 2, 3, 4, 5]


class _SlowCoordinator:
    """Hands out the points after the asked sequence number, one at a time, slowly: two handles' calls
    overlap."""

    def __init__(self, points: list[MetricPoint]) -> None:
        self.points = points

    @property
    def metrics_since(self) -> Any:
        points = self.points

        class _Call:
            @staticmethod
            def remote(seq: int, wait_s: float) -> tuple[int, list[MetricPoint], bool]:
                time.sleep(0.002)
                return min(seq + 1, len(points)), points[seq : seq + 1], seq + 1 >= len(points)

        return _Call()


def test_two_threads_polling_one_handle_never_both_get_a_point(monkeypatch, tmp_path: Path) -> None:
    """A notebook's `metrics()` loop beside `follow` (or a second loop) on one handle."""
    monkeypatch.setattr(client_module.ray, "get", lambda answer: answer)
    job = TrainingJob(build_job(toy_job("order", tmp_path)))
    job._handle = _SlowCoordinator([_train(s) for s in range(1, 101)])
    got: list[list[int]] = [[], []]

    def drain(into: list[int]) -> None:
        into.extend(p.step for p in job.metrics(timeout=20))

    threads = [threading.Thread(target=drain, args=(into,)) for into in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got[0] + got[1]) == list(range(1, 101))


# -- a run on Ray --------------------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.usefixtures("_ray")
def test_a_restarted_runs_metrics_arrive_in_step_order_each_step_once(tmp_path: Path) -> None:
    """Rank 1 fails at step 7, after the losses of steps 5 and 6 were reported (slow steps: the courier
    delivers each before the next) and before they were committed (period 4): the run restarts from step 4
    and reports steps 5 and 6 a second time."""
    model = {"options": {"faults": [{"kind": "raise", "step": 7, "rank": 1}], "step_sleep_s": 0.25}}
    job = toy_job("ordered", tmp_path, steps=10, checkpointing={"period": 4}, model=model)
    handle = TrainingJob(build_job(job)).start()

    points = list(handle.metrics(timeout=90))

    assert handle.result(timeout=30).restarts == 1
    assert [p.step for p in points if p.kind == "train"] == list(range(1, 11))
    streams: dict[tuple[str, int, tuple[str, ...]], list[int]] = {}
    for p in points:
        if p.rank >= 0 and not is_setup_point(p):
            streams.setdefault((p.kind, p.rank, tuple(sorted(p.values))), []).append(p.step)
    assert all(steps == sorted(set(steps)) for steps in streams.values()), streams
    # Each attempt's ranks timed their own start-up: rank 1's at step 0 both times, rank 0's at the step
    # its attempt started from.
    assert sorted((p.rank, p.step) for p in points if is_setup_point(p)) == [(0, 0), (0, 4), (1, 0), (1, 0)]
    # The coordinator did receive steps 5 and 6 twice: what a handle gets as received says so.
    received, _ = TrainingJob.attach("ordered").poll_metrics(5.0, as_received=True)
    assert [p.step for p in received if p.kind == "train"] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10]
