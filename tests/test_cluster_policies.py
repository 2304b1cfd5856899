"""The coordinator's decisions as plain Python (no Ray instance): failure policy, scaling policy, the
controller's state step, the command mailbox, the health checks and the metrics path."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from d9d.cluster import NonRetryableError
from d9d.cluster.control.controller import End, Reserve, Restart, Run, after_attempt, job_state_of
from d9d.cluster.control.failure import FailurePolicy, GiveUp, Retry, is_retryable
from d9d.cluster.control.health import Limits, Liveness, first_failure, hang, missed_heartbeats, stragglers
from d9d.cluster.control.mailbox import CommandMailbox
from d9d.cluster.control.metrics import CLUSTER_RANK, MetricsHub
from d9d.cluster.control.outcome import Failed, Finished, Outcome, Resize, Stopped
from d9d.cluster.control.scaling import ScalingPolicy
from d9d.cluster.sink import MetricsWriter
from d9d.cluster.spec import build_job
from d9d.cluster.state import TRANSITIONS, JobState, StateMachine
from d9d.engine.runtime import Command, CommandKind, MetricPoint
from d9d.engine.tracking_sink import TrackerSink
from d9d.tracking import RunSpec
from tests.cluster_fixtures import toy_job

pytestmark = pytest.mark.timeout(60)


# -- failure policy -----------------------------------------------------------------------------------------


def test_failure_policy_backs_off_exponentially_up_to_the_cap_then_gives_up() -> None:
    policy = FailurePolicy(max_failures=4, backoff_s=0.5, max_backoff_s=3.0)
    decisions = [policy.decide(Failed(f"boom {i}")) for i in range(5)]
    assert decisions[:4] == [Retry(0.5), Retry(1.0), Retry(2.0), Retry(3.0)]
    assert isinstance(decisions[4], GiveUp)
    assert "gave up after 5 failures (cluster.max_failures=4)" in decisions[4].error
    assert "boom 4" in decisions[4].error
    assert policy.failures == [f"boom {i}" for i in range(5)]


def test_failure_policy_with_no_budget_gives_up_on_the_first_failure() -> None:
    assert isinstance(FailurePolicy(0, 1.0, 10.0).decide(Failed("x")), GiveUp)


def test_a_non_retryable_failure_ends_the_run_with_budget_left() -> None:
    policy = FailurePolicy(max_failures=10, backoff_s=1.0, max_backoff_s=10.0)
    decision = policy.decide(Failed("rank 0: bad input", retryable=False))
    assert decision == GiveUp("not retryable: rank 0: bad input")
    assert policy.failures == ["rank 0: bad input"]


class _RayTaskError(Exception):
    pass


class _WrappedByRay(_RayTaskError, NonRetryableError):
    """Ray re-raises a rank's error as a class deriving from both its own error and the rank's class."""


@pytest.mark.parametrize(
    ("error", "retryable"),
    [
        (RuntimeError("collective timed out"), True),
        (ConnectionError("peer gone"), True),
        (NonRetryableError("config rejected"), False),
        (_WrappedByRay("config rejected"), False),
    ],
)
def test_retryable_classification(error: BaseException, retryable: bool) -> None:
    assert is_retryable(error) is retryable


# -- controller states --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (Finished(), End(JobState.FINISHED)),
        (Stopped("killed by request"), End(JobState.STOPPED)),
        (Resize(4), Restart(4, growing=True, decision=Retry(0.0))),
        (Failed("rank 1: died"), Restart(2, growing=False, decision=Retry(1.0))),
        (
            Failed("rank 1: bad", retryable=False),
            Restart(2, growing=False, decision=GiveUp("not retryable: rank 1: bad")),
        ),
    ],
)
def test_after_attempt(outcome: Outcome, expected: object) -> None:
    policy = FailurePolicy(max_failures=3, backoff_s=1.0, max_backoff_s=8.0)
    assert after_attempt(outcome, policy, initial_workers=2) == expected


def test_a_resize_does_not_spend_the_failure_budget() -> None:
    policy = FailurePolicy(max_failures=0, backoff_s=1.0, max_backoff_s=8.0)
    after_attempt(Resize(4), policy, initial_workers=2)
    assert policy.failures == []


def _walk(outcomes: Sequence[Outcome], policy: FailurePolicy) -> list[JobState]:
    """The job states a run passes through when its attempts end with `outcomes`, driven through the
    controller's step function and the real state machine (which rejects illegal moves)."""
    machine = StateMachine()
    state: Any = Reserve(2, growing=False)
    for outcome in outcomes:
        entered = job_state_of(state)
        assert entered is not None
        machine.to(entered)
        machine.to(JobState.RUNNING)  # what the runner does once the ranks run (Run enters nothing)
        assert job_state_of(Run(attempt=None)) is None  # type: ignore[arg-type]
        state = after_attempt(outcome, policy, initial_workers=2)
        if isinstance(state, Restart):
            machine.to(JobState.RESTARTING)
            state = (
                End(JobState.FAILED, state.decision.error)
                if isinstance(state.decision, GiveUp)
                else Reserve(state.target, state.growing)
            )
    assert isinstance(state, End)
    machine.to(state.state)
    return [s for _, s in machine.history]


def test_state_walk_of_a_run_that_fails_grows_and_finishes() -> None:
    policy = FailurePolicy(max_failures=3, backoff_s=0.0, max_backoff_s=0.0)
    history = _walk([Failed("rank 0: died"), Resize(4), Finished()], policy)
    start, run, restart = JobState.STARTING, JobState.RUNNING, JobState.RESTARTING
    assert history == [
        JobState.PENDING, start, run, restart, start, run, restart, start, run, JobState.FINISHED
    ]  # fmt: skip


def test_state_walk_ends_failed_when_the_budget_is_spent() -> None:
    policy = FailurePolicy(max_failures=1, backoff_s=0.0, max_backoff_s=0.0)
    history = _walk([Failed("a"), Failed("b")], policy)
    assert history[-2:] == [JobState.RESTARTING, JobState.FAILED]
    assert history.count(JobState.RUNNING) == 2


def test_every_controller_state_enters_a_state_the_table_knows() -> None:
    states = [
        Reserve(1, growing=False),
        Restart(1, growing=False, decision=Retry(0.0)),
        End(JobState.STOPPED),
    ]
    for state in states:
        entered = job_state_of(state)
        assert entered is not None and entered in TRANSITIONS


# -- scaling policy -----------------------------------------------------------------------------------------


def _elastic(tmp_path: Path) -> ScalingPolicy:
    # global batch 8 → valid data-parallel degrees 1, 2, 4 (one rank per replica)
    job = toy_job("scale", tmp_path / "run", world=4, cluster={"min_workers": 1, "max_workers": 4})
    return ScalingPolicy.for_job(build_job(job))


def test_candidates_are_the_layouts_that_fit_largest_first(tmp_path: Path) -> None:
    policy = _elastic(tmp_path)
    assert [p.world_size for p in policy.candidates(4, capacity=10)] == [4, 2, 1]
    assert [p.world_size for p in policy.candidates(4, capacity=3)] == [2, 1]
    assert [p.world_size for p in policy.candidates(2, capacity=10)] == [2, 1]
    # nothing fits: the smallest layout, to wait for a node
    assert [p.world_size for p in policy.candidates(4, capacity=0)] == [1]


def test_a_fixed_size_job_has_one_candidate_and_never_grows(tmp_path: Path) -> None:
    policy = ScalingPolicy.for_job(build_job(toy_job("fixed", tmp_path / "run")))
    assert [p.world_size for p in policy.candidates(2, capacity=1)] == [2]
    assert policy.grow_to(2, free=100, alive=frozenset({"a"})) is None


def test_grow_to_the_largest_valid_layout_the_free_room_allows(tmp_path: Path) -> None:
    policy = _elastic(tmp_path)
    nodes = frozenset({"a", "b"})
    assert policy.grow_to(1, free=0, alive=nodes) is None
    assert policy.grow_to(1, free=1, alive=nodes) == 2
    assert policy.grow_to(2, free=1, alive=nodes) is None  # 3 ranks is no valid layout
    assert policy.grow_to(2, free=5, alive=nodes) == 4  # capped at max_workers
    assert policy.grow_to(4, free=5, alive=nodes) is None


def test_a_resize_that_fell_short_blocks_growing_until_the_nodes_change(tmp_path: Path) -> None:
    policy = _elastic(tmp_path)
    nodes = frozenset({"a", "b"})
    policy.resize_reserved(4, 4, nodes)  # got what it aimed for: nothing blocked
    assert policy.grow_to(2, free=2, alive=nodes) == 4
    policy.resize_reserved(4, 2, nodes)
    assert policy.grow_to(2, free=2, alive=nodes) is None
    assert policy.grow_to(2, free=2, alive=nodes | {"c"}) == 4


# -- command mailbox ----------------------------------------------------------------------------------------


def test_mailbox_flags_and_delivery() -> None:
    box = CommandMailbox()
    box.post(Command(CommandKind.PAUSE))
    assert box.paused and not box.stop
    box.post(Command(CommandKind.RESUME))
    assert not box.paused
    seq, commands = box.since(0)
    assert seq == 2 and [c.kind for c in commands] == [CommandKind.PAUSE, CommandKind.RESUME]
    assert box.delivered == 2
    box.post(Command(CommandKind.STOP))
    assert box.stop and not box.kill
    assert [c.kind for c in box.since(2)[1]] == [CommandKind.STOP]
    box.request_kill()
    assert box.kill


def test_mailbox_hands_out_a_resize_once() -> None:
    box = CommandMailbox()
    assert box.take_resize() is None
    box.request_resize(4)
    assert box.take_resize() == 4
    assert box.take_resize() is None


def test_mailbox_sleep_implies_pause_wake_stays_paused_resume_runs() -> None:
    box = CommandMailbox()
    box.post(Command(CommandKind.SLEEP))
    assert box.paused and box.asleep
    box.post(Command(CommandKind.WAKE))
    assert box.paused and not box.asleep
    box.post(Command(CommandKind.SLEEP))
    box.post(Command(CommandKind.RESUME))
    assert not box.paused and not box.asleep


def test_metrics_hub_tracks_what_rank_0_reported_about_sleep() -> None:
    hub = MetricsHub(MetricsWriter(lambda: _Sink(), min_interval_s=0.0))
    hub.add(_point(3, 1, "health", asleep=1.0))  # another rank's point is not the job's state
    assert not hub.asleep
    hub.add(_point(3, 0, "health", asleep=1.0, offloaded_bytes=64.0))
    assert hub.asleep
    hub.add(_point(3, 0, "health", paused=1.0))
    assert hub.asleep
    hub.add(_point(3, 0, "health", asleep=0.0, wake_s=0.1))
    assert not hub.asleep


# -- health checks ------------------------------------------------------------------------------------------

LIMITS = Limits(step_timeout_s=10.0, init_timeout_s=60.0, heartbeat_timeout_s=5.0)


def test_hang_uses_the_init_limit_until_a_step_completed() -> None:
    live = Liveness(world_size=2, progress=100.0)
    assert hang(live, LIMITS, now=150.0, paused=False) is None
    failure = hang(live, LIMITS, now=161.0, paused=False)
    assert failure is not None and "first step (init timeout)" in failure.reason
    live.step_done = True
    failure = hang(live, LIMITS, now=111.0, paused=False)
    assert failure is not None and "no step completed for 11.0s (limit 10.0s)" in failure.reason
    assert failure.hung
    assert hang(live, LIMITS, now=1000.0, paused=True) is None


def test_missed_heartbeats_name_the_rank() -> None:
    live = Liveness(world_size=2, heartbeats={0: 100.0, 1: 96.0})
    assert missed_heartbeats(live, LIMITS, now=100.5, paused=False) is None
    # hung: the runner collects every rank's stacks before the teardown (d9d.cluster.control.hang)
    assert missed_heartbeats(live, LIMITS, now=101.5, paused=False) == Failed(
        "rank 1: no heartbeat for 5.5s", hung=True
    )


def test_stragglers_are_the_ranks_that_did_not_return() -> None:
    live = Liveness(world_size=3, returned=frozenset({0, 2}), first_returned=50.0)
    assert stragglers(live, LIMITS, now=60.0, paused=False) is None
    assert stragglers(live, LIMITS, now=60.5, paused=False) == Failed(
        "ranks [1] did not finish 10.0s after the others", hung=True
    )
    assert stragglers(Liveness(world_size=3), LIMITS, now=1e9, paused=False) is None


def test_first_failure_reports_nothing_for_a_healthy_attempt() -> None:
    now = time.monotonic()
    live = Liveness(world_size=2, heartbeats={0: now, 1: now}, progress=now, step_done=True)
    assert first_failure(live, LIMITS, now + 1.0, paused=False) is None


# -- metrics ------------------------------------------------------------------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.written: list[MetricPoint] = []
        self.status: str | None = None

    def write(self, points: Sequence[MetricPoint]) -> None:
        self.written.extend(points)

    def close(self, status: str) -> None:
        self.status = status


def _point(step: int, rank: int = 0, kind: str = "train", **values: float) -> MetricPoint:
    return MetricPoint(step, rank, values or {"loss": 1.0 / step}, kind, time.time())  # type: ignore[arg-type]


def test_metrics_hub_numbers_every_point_and_writes_each_step_once() -> None:
    sink = _Sink()
    hub = MetricsHub(MetricsWriter(lambda: sink, min_interval_s=0.0))
    for step in (1, 2, 3, 2, 3, 4):  # a restart recomputes steps 2 and 3
        hub.add(_point(step))
    hub.add(_point(2, CLUSTER_RANK, "health", world_size=1.0))  # the coordinator's own: always written
    assert hub.seq == 7
    assert [p.step for p in hub.since(4)] == [3, 4, 2]
    assert hub.losses == {1: 1.0, 2: 0.5, 3: 1 / 3, 4: 0.25} and hub.last_loss == 0.25
    hub.final_loss(4, 9.0)  # a point already carried step 4's loss
    hub.final_loss(5, 0.2)
    assert hub.last_loss == 0.2
    hub.close(JobState.STOPPED)
    assert [(p.rank, p.step) for p in sink.written] == [(0, 1), (0, 2), (0, 3), (0, 4), (CLUSTER_RANK, 2)]
    assert sink.status == "killed"


class _Tracker:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.opened: object = "never"
        self.closed: str | None = None

    def open(self, run: RunSpec, resume: object) -> None:
        self.opened = resume

    def resume_state(self) -> dict[str, str]:
        return {"run_id": "r1"}

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        self.logged.append((step, values))

    def close(self, status: str) -> None:
        self.closed = status


@pytest.mark.parametrize("report_lag", [False, True])
def test_tracker_sink_merges_a_step_and_names_health_and_cluster_points(
    tmp_path: Path, report_lag: bool
) -> None:
    tracker = _Tracker()
    state = tmp_path / "tracker_state.json"
    sink = TrackerSink(tracker, RunSpec("r"), state, resume=True, report_lag=report_lag)  # type: ignore[arg-type]
    assert tracker.opened is None and state.read_text() == '{"run_id": "r1"}'
    sink.write(
        [
            _point(1, loss=2.0),
            _point(1, 1, "health", mem=3.0),
            _point(1, CLUSTER_RANK, "health", world_size=2.0),
        ]
    )
    sink(_point(2, loss=1.0))
    (step1, first), (step2, second) = tracker.logged
    assert (step1, step2) == (1, 2)
    assert {k: v for k, v in first.items() if k != "system/cluster/metrics_lag_s"} == {
        "train/loss": 2.0,
        "system/rank1/mem": 3.0,
        "system/cluster/world_size": 2.0,
    }
    assert ("system/cluster/metrics_lag_s" in first) is report_lag and first.get(
        "system/cluster/metrics_lag_s", 0.0
    ) >= 0.0
    assert second == {
        "train/loss": 1.0,
        **({"system/cluster/metrics_lag_s": second["system/cluster/metrics_lag_s"]} if report_lag else {}),
    }
    TrackerSink(tracker, RunSpec("r"), state, resume=True)  # type: ignore[arg-type]
    assert tracker.opened == {"run_id": "r1"}
    TrackerSink(tracker, RunSpec("r"), state, resume=False)  # type: ignore[arg-type]
    assert tracker.opened is None


# -- the controller's loop, with a fake worker group and runner --------------------------------------------


class _FakeWorkers:
    def __init__(self, policy: ScalingPolicy, capacity: list[int]) -> None:
        self.policy = policy
        self.capacity = capacity  # per reservation
        self.torn_down: list[int] = []

    async def reserve(self, target: int) -> tuple[Any, Any] | None:
        return self.policy.candidates(target, self.capacity.pop(0))[0], "pg"

    async def teardown(self, at: Any) -> None:
        self.torn_down.append(at.index)

    def free(self) -> int:
        return 0

    def alive(self) -> frozenset[str]:
        return frozenset({"head"})


class _FakeRunner:
    def __init__(self, outcomes: list[Outcome]) -> None:
        self.outcomes = outcomes
        self.machine: StateMachine | None = None
        self.ran: list[tuple[int, int]] = []  # (attempt index, world size)

    async def run(self, at: Any) -> Outcome:
        assert self.machine is not None
        self.machine.to(JobState.RUNNING)  # as the real runner does once the ranks run
        self.ran.append((at.index, at.plan.world_size))
        return self.outcomes.pop(0)


def _controller(
    tmp_path: Path,
    outcomes: list[Outcome],
    capacity: list[int],
    mailbox: CommandMailbox | None = None,
    changes: Any = None,
    **cluster: Any,
) -> Any:
    from d9d.cluster.checkpoints import CheckpointStore
    from d9d.cluster.control.controller import Controller
    from d9d.cluster.control.signal import Changes

    mailbox = mailbox or CommandMailbox()
    changes = changes or Changes()
    job = toy_job("ctl", tmp_path / "run", world=4, cluster={"min_workers": 1, "max_workers": 4, **cluster})
    spec = build_job(job)
    workers = _FakeWorkers(ScalingPolicy.for_job(spec), capacity)
    runner = _FakeRunner(outcomes)
    hub = MetricsHub(MetricsWriter(lambda: _Sink(), min_interval_s=0.0))
    store = CheckpointStore(spec.checkpoint_dir, 2)
    ctl = Controller(spec, store, mailbox, hub, changes, workers=workers, runner=runner)
    runner.machine = ctl.machine
    return ctl, workers, runner


def test_controller_restarts_shrinks_grows_and_finishes(tmp_path: Path) -> None:
    import asyncio

    outcomes: list[Outcome] = [Failed("rank 3: node lost"), Resize(4), Finished()]
    ctl, workers, runner = _controller(tmp_path, outcomes, capacity=[4, 2, 4], restart_backoff_s=0.01)
    state = asyncio.run(ctl.run())
    summary = ctl.finish(state)

    assert state is JobState.FINISHED
    assert runner.ran == [(0, 4), (1, 2), (2, 4)]
    assert workers.torn_down == [0, 1, 2]
    assert (summary.world_sizes, summary.resizes, summary.failures) == ([4, 2, 4], 1, ["rank 3: node lost"])
    assert summary.restarts == 2 and summary.error is None
    start, run, restart = JobState.STARTING, JobState.RUNNING, JobState.RESTARTING
    assert [s for _, s in ctl.machine.history] == [
        JobState.PENDING, start, run, restart, start, run, restart, start, run, JobState.FINISHED
    ]  # fmt: skip
    assert (tmp_path / "run" / "run_summary.json").is_file()


def test_controller_gives_up_when_the_budget_is_spent(tmp_path: Path) -> None:
    import asyncio

    outcomes: list[Outcome] = [Failed("a"), Failed("b")]
    ctl, workers, runner = _controller(
        tmp_path, outcomes, capacity=[4, 4], max_failures=1, restart_backoff_s=0.01
    )
    state = asyncio.run(ctl.run())

    assert state is JobState.FAILED and len(runner.ran) == 2
    assert ctl.summary.error == "gave up after 2 failures (cluster.max_failures=1); last: b"
    assert workers.torn_down == [0, 1]
    assert ctl.machine.state is JobState.RESTARTING  # `finish` enters the terminal state


def test_controller_stops_before_reserving_again_after_a_stop(tmp_path: Path) -> None:
    import asyncio

    from d9d.cluster.control.signal import Changes

    async def main() -> JobState:
        mailbox, changes = CommandMailbox(), Changes()
        ctl, _, runner = _controller(tmp_path, [Failed("a")], [4], mailbox, changes, restart_backoff_s=30.0)
        task = asyncio.create_task(ctl.run())
        while ctl.machine.state is not JobState.RESTARTING:
            await asyncio.sleep(0.01)
        mailbox.post(Command(CommandKind.STOP))  # a client's stop during the 30 s backoff
        await changes.notify()
        state = await task
        assert len(runner.ran) == 1
        return state

    assert asyncio.run(main()) is JobState.STOPPED


def test_of_ranks_failing_together_the_first_own_exception_then_a_dead_process_names_the_failure() -> None:
    """A broken collective (what the peers of a rank that raised or died see) names the failure only when
    nothing better arrives within the grace; a rank's own exception wins even when it arrived later."""
    from ray.exceptions import RayActorError

    from d9d.cluster.control.failure import RankError, blame
    from d9d.cluster.control.runner import attempt_errors, rank_error

    gloo = rank_error(0, RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"), 1.0)
    own = rank_error(2, KeyError("no such expert"), 1.5)
    later = rank_error(3, ValueError("second"), 1.6)
    dead = rank_error(1, RayActorError(), 1.2)
    assert gloo.collective and not own.collective and dead.died and own.type == "KeyError"

    assert blame([gloo, dead, own, later], now=1.7, all_done=False) is own
    assert blame([gloo, dead], now=1.7, all_done=False) is dead
    assert blame([gloo], now=2.0, all_done=False) is None  # within the grace: the cause may still come
    assert blame([gloo], now=3.1, all_done=False) is gloo
    assert blame([gloo], now=1.1, all_done=True) is gloo  # nothing more can come
    assert blame([], now=9.0, all_done=True) is None

    # A rank's report and its failed call are one exception: the report (which came first) stands.
    reported = RankError(2, "KeyError", "no such expert", step=7, seen_at=1.4)
    assert attempt_errors([reported], {2: own, 0: gloo}) == [gloo, reported]

    failed = reported.outcome(before_first_step=False)
    assert failed.reason == "rank 2: KeyError: no such expert (step 7)" and failed.retryable
    assert failed.step == 7 and failed.key == "KeyError: no such expert"
    assert not gloo.outcome(before_first_step=False).key  # a broken collective never counts as recurring
    assert not RankError(0, "ValueError", "bad", setup_error=True).outcome(before_first_step=True).retryable


def test_the_same_exception_at_the_same_step_after_a_restart_is_not_retried_again() -> None:
    policy = FailurePolicy(max_failures=5, backoff_s=0.0, max_backoff_s=0.0)
    boom = Failed(
        "rank 1: RuntimeError: boom (step 3)", detail="Traceback ...", step=3, key="RuntimeError: boom"
    )
    assert isinstance(policy.decide(boom), Retry)
    # Another step, another message, or no step known: the restart budget decides.
    assert isinstance(policy.decide(Failed("x", step=4, key="RuntimeError: boom")), Retry)
    assert isinstance(policy.decide(Failed("x", step=3, key="RuntimeError: other")), Retry)
    assert isinstance(policy.decide(Failed("rank 1: process died")), Retry)
    decision = policy.decide(boom)
    assert isinstance(decision, GiveUp)
    assert decision.error.startswith("rank 1: RuntimeError: boom (step 3), again after a restart")
    assert decision.error.endswith("Traceback ...")


def test_a_reported_rank_error_ends_the_attempt_without_waiting_for_the_ranks(tmp_path: Path) -> None:
    """On NCCL a rank that raised may hang tearing its process group down, and its peers hang in the
    collective: the reported error alone ends the attempt (the teardown then kills every rank)."""
    import asyncio
    from types import SimpleNamespace

    from d9d.cluster.control.failure import RankError
    from d9d.cluster.control.runner import AttemptRunner

    live = Liveness(2)
    live.heartbeats = {0: time.monotonic(), 1: time.monotonic()}
    runner = AttemptRunner(
        spec=build_job(toy_job("watch", tmp_path)),
        workers=None,  # type: ignore[arg-type]
        mailbox=CommandMailbox(),
        metrics=None,  # type: ignore[arg-type]
        machine=StateMachine(),
        changes=None,  # type: ignore[arg-type]
        on_result=lambda result: None,
    )

    async def watch() -> tuple[Outcome, float]:
        loop = asyncio.get_running_loop()
        runs = {loop.create_future(): 0, loop.create_future(): 1}  # never complete
        loop.call_later(
            0.3,
            live.errors.append,
            RankError(1, "RuntimeError", "compiled backward", seen_at=time.monotonic()),
        )
        started = time.monotonic()
        outcome = await runner._watch(SimpleNamespace(live=live), runs)  # type: ignore[arg-type]
        return outcome, time.monotonic() - started

    outcome, took = asyncio.run(watch())
    assert isinstance(outcome, Failed) and outcome.reason == "rank 1: RuntimeError: compiled backward"
    assert took < 1.0


Reports = Callable[[Any, Any, Any, Callable[[], None]], None]
"""(controller, its attempt, the metrics hub, `take`: note the resize the mailbox holds, if any)."""


def _grow_requests(
    tmp_path: Path, period: int, report: Reports, abandoned: dict[int, float] | None = None
) -> list[int | None]:
    """The resizes a controller asks for while `report` plays rank 0's reports of one attempt on a cluster
    with room for two more ranks (each entry: what the mailbox held at a `take`). `abandoned`: losses an
    earlier attempt reported past the commit this one starts from (here: from scratch)."""
    import asyncio

    from d9d.cluster.checkpoints import CheckpointStore
    from d9d.cluster.control.controller import Controller
    from d9d.cluster.control.signal import Changes

    mailbox = CommandMailbox()

    class _Roomy(_FakeWorkers):
        def free(self) -> int:
            return 2

    asked: list[int | None] = []

    class _Reports(_FakeRunner):
        async def run(self, at: Any) -> Outcome:
            outcome = await super().run(at)
            report(ctl, at, hub, lambda: asked.append(mailbox.take_resize()))
            return outcome

    job = toy_job("grow", tmp_path / "run", world=2, cluster={"min_workers": 1, "max_workers": 4})
    job["logging"] = {"period": period}
    spec = build_job(job)
    runner = _Reports([Finished()])
    hub = MetricsHub(MetricsWriter(lambda: _Sink(), min_interval_s=0.0))
    for step, loss in (abandoned or {}).items():
        hub.add(MetricPoint(step, 0, {"loss": loss}, "train", 0.0))
    ctl = Controller(
        spec,
        CheckpointStore(spec.checkpoint_dir, 2),
        mailbox,
        hub,
        Changes(),
        workers=_Roomy(ScalingPolicy.for_job(spec), [2]),
        runner=runner,
    )
    runner.machine = ctl.machine
    asyncio.run(ctl.run())
    return asked


def _loss(hub: Any, ctl: Any, step: int) -> None:
    """Rank 0's loss point for `step` arriving, as the coordinator accepts it (recorded, then seen)."""
    hub.add(MetricPoint(step, 0, {"loss": 1.0}, "train", 0.0))
    ctl.step_seen(step)


def test_a_grow_decided_at_a_commit_waits_for_that_steps_loss(tmp_path: Path) -> None:
    """The resize that a commit allows is asked for only once rank 0's loss of the committed step arrived:
    the new ranks resume after that step and never report it again. A later step's boundary is no proof —
    calls to the coordinator actor may run out of order, and a resize that trusted one lost the committed
    step's loss under load (tests/test_cluster_elastic_engine.py, session 18)."""

    def report(ctl: Any, at: Any, hub: Any, take: Callable[[], None]) -> None:
        ctl.step_seen(5)
        ctl.committed(at, 6)  # the commit's RPC overtook rank 0's report of step 6
        take()
        ctl.step_seen(6)  # step 6's boundary, its loss still on the way
        take()
        ctl.step_seen(7)  # a later boundary ran before the report carrying step 6's loss
        take()
        _loss(hub, ctl, 6)
        take()
        ctl.committed(at, 8)
        _loss(hub, ctl, 8)
        take()

    assert _grow_requests(tmp_path, 1, report) == [None, None, None, 4, 4]


def test_a_grow_waits_for_the_retrained_loss_not_an_abandoned_attempts(tmp_path: Path) -> None:
    """An earlier attempt reported steps 1-8 and failed before committing any; this one starts from scratch.
    The grow at its commit of step 8 waits for this attempt's loss of step 8, and the summary keeps that
    loss, not the abandoned attempt's."""
    seen: dict[int, float] = {}

    def report(ctl: Any, at: Any, hub: Any, take: Callable[[], None]) -> None:
        assert hub.losses == {}  # the abandoned attempt's losses are not this attempt's
        ctl.committed(at, 8)
        take()
        hub.add(MetricPoint(8, 0, {"loss": 2.5}, "train", 0.0))
        ctl.step_seen(8)
        take()
        seen.update(hub.losses)

    assert _grow_requests(tmp_path, 1, report, abandoned={s: 9.0 for s in range(1, 9)}) == [None, 4]
    assert seen == {8: 2.5}


def test_a_grow_at_a_commit_whose_loss_is_not_logged_waits_for_the_next_boundary(tmp_path: Path) -> None:
    """With `logging.period: 2` step 7 reports no loss: the boundary after it is the report to wait for."""

    def report(ctl: Any, at: Any, hub: Any, take: Callable[[], None]) -> None:
        ctl.committed(at, 7)
        take()
        ctl.step_seen(7)
        take()
        ctl.step_seen(8)
        take()

    assert _grow_requests(tmp_path, 2, report) == [None, None, 4]
