"""Schedules compiled into programs, run through the simulator: deadlock freedom, textbook bubbles, memory."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from d9d.pipeline.schedule.actions import Compute, ComputeKind, Direction, Recv, Send, Transfer
from d9d.pipeline.schedule.config import ScheduleConfig, build_schedule
from d9d.pipeline.schedule.placement import StagePlacement
from d9d.pipeline.schedule.program import PipelineProgram
from d9d.pipeline.simulator.checks import ScheduleError
from d9d.pipeline.simulator.costs import ActionCosts
from d9d.pipeline.simulator.simulate import PipelineDeadlockError, SimulationResult, simulate

adapter: TypeAdapter[ScheduleConfig] = TypeAdapter(ScheduleConfig)
KINDS = ["inference", "gpipe", "1f1b", "zb1p", "interleaved_1f1b", "zbv", "dualpipev"]


def run(kind: str, pp: int, m: int, costs: ActionCosts | None = None, **options: object) -> SimulationResult:
    return simulate(build_schedule(adapter.validate_python({"kind": kind, **options}), pp, m), costs)


def idle(result: SimulationResult) -> list[float]:
    return [r.idle for r in result.ranks]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_every_accepted_combination_runs_without_deadlock(kind: str, pp: int) -> None:
    """Either the schedule refuses (pp, m) at build time, or the simulator runs it to the end."""
    options = {"stages_per_rank": 3} if kind == "interleaved_1f1b" else {}
    for m in range(1, 3 * pp + 2):
        config = adapter.validate_python({"kind": kind, **options})
        try:
            program = build_schedule(config, pp, m)
        except ValueError as e:
            refused = (kind == "interleaved_1f1b" and m % pp) or (kind == "dualpipev" and m < 2 * pp - 1)
            assert refused, f"{kind} pp={pp} m={m} refused: {e}"
            continue
        result = simulate(program)  # raises on deadlock or an inconsistent program
        per_rank = (m * config.stages_per_rank) * (1 if kind == "inference" else 3)
        assert all(r.busy == per_rank for r in result.ranks), (kind, pp, m)


@pytest.mark.parametrize(("pp", "m"), [(2, 2), (2, 5), (4, 4), (4, 8), (4, 11), (8, 16)])
def test_1f1b_and_gpipe_bubble_is_textbook(pp: int, m: int) -> None:
    expected = (pp - 1) / (m + pp - 1)
    for kind in ("1f1b", "gpipe"):
        result = run(kind, pp, m)
        assert [r.bubble_fraction for r in result.ranks] == pytest.approx([expected] * pp), kind
    # The ratio of forward to backward cost does not matter.
    skewed = run("1f1b", pp, m, ActionCosts(forward=1.0, backward_input=1.5, backward_weight=0.5))
    assert skewed.bubble_fraction == pytest.approx(expected)


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 12, 4), (8, 16, 2)])
def test_interleaved_divides_the_fill_by_the_number_of_chunks(pp: int, m: int, v: int) -> None:
    result = run("interleaved_1f1b", pp, m, stages_per_rank=v)
    assert result.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert result.bubble_fraction < run("1f1b", pp, m).bubble_fraction


@pytest.mark.parametrize(("pp", "m"), [(2, 2), (3, 7), (4, 4), (4, 8), (8, 24)])
def test_zb1p_idles_a_third_of_1f1b(pp: int, m: int) -> None:
    """With F = I = W = 1, 1F1B idles (p - 1)(F + I + W) per rank and ZB1P (p - 1)(F + I - W)."""
    zb, base = run("zb1p", pp, m), run("1f1b", pp, m)
    assert idle(zb) == [pp - 1] * pp
    assert idle(base) == [3 * (pp - 1)] * pp
    assert zb.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1))
    assert zb.peak_activations == base.peak_activations == pp  # same memory as 1F1B's first rank


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (2, 7), (4, 8), (4, 9), (4, 16), (8, 16)])
def test_v_schedules_are_near_bubble_free_once_m_reaches_2p(pp: int, m: int) -> None:
    """Rank p - 1 cannot start before p - 1 chunk forwards, so p - 1 idle slots per rank is the floor."""
    zbv, dual, base = run("zbv", pp, m), run("dualpipev", pp, m), run("1f1b", pp, m)
    assert idle(zbv) == [pp - 1] * pp
    assert zbv.bubble_fraction == pytest.approx((pp - 1) / (6 * m + pp - 1))
    assert zbv.peak_activations == 2 * pp  # chunks are half stages: 1F1B's peak
    assert idle(dual) == [2 * (pp - 1)] * pp
    assert dual.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1))
    assert zbv.bubble_fraction <= base.bubble_fraction / 4
    assert dual.bubble_fraction <= base.bubble_fraction / 2


def test_dualpipev_overlap_shortens_the_step() -> None:
    plain = run("dualpipev", 4, 8)
    overlapped = run("dualpipev", 4, 8, ActionCosts(overlap_factor=0.6))
    assert overlapped.makespan < plain.makespan


def test_peak_activations() -> None:
    assert [r.peak_activations for r in run("1f1b", 4, 8).ranks] == [4, 3, 2, 1]
    assert [r.peak_activations for r in run("gpipe", 4, 8).ranks] == [8] * 4
    assert [r.peak_activations for r in run("inference", 4, 8).ranks] == [1] * 4


def test_communication_latency_delays_the_step() -> None:
    latency = ActionCosts(communication=0.5)
    fast, slow = run("1f1b", 4, 8), run("1f1b", 4, 8, latency)
    # At least the 2 (p - 1) hops of the first microbatch's round trip pay the latency.
    assert slow.makespan >= fast.makespan + 0.5 * 2 * 3
    assert run("1f1b", 1, 8, latency).makespan == run("1f1b", 1, 8).makespan  # nothing to send


# -- configs -----------------------------------------------------------------------------------------------


def test_configs_parse_from_plain_data() -> None:
    config = adapter.validate_python({"kind": "interleaved_1f1b", "stages_per_rank": 3})
    assert config.stages_per_rank == 3
    assert adapter.validate_python({"kind": "zbv"}).stages_per_rank == 2
    assert adapter.validate_python({"kind": "1f1b"}).stages_per_rank == 1
    program = build_schedule(config, 2, 4)
    assert program.num_stages == 6 and program.placement.stages_of(1) == (1, 3, 5)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"kind": "pipedream"}, "kind"),
        ({"kind": "1f1b", "stages_per_rank": 2}, "stages_per_rank"),
        ({"kind": "interleaved_1f1b", "stages_per_rank": 1}, "stages_per_rank"),
        ({"kind": "zbv", "warmup": 3}, "warmup"),
    ],
)
def test_invalid_configs_fail_validation(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        adapter.validate_python(raw)


@pytest.mark.parametrize(
    ("kind", "pp", "m", "message"),
    [
        ("dualpipev", 4, 6, "at least 2 × pipeline_parallel - 1 = 7 microbatches, got 6"),
        ("interleaved_1f1b", 4, 6, r"microbatches \(6\) to be a multiple of pipeline_parallel \(4\)"),
        ("1f1b", 4, 0, "microbatches must be >= 1"),
        ("gpipe", 0, 4, "pipeline_parallel must be >= 1"),
    ],
)
def test_impossible_shapes_are_refused_when_building(kind: str, pp: int, m: int, message: str) -> None:
    config = adapter.validate_python({"kind": kind})
    with pytest.raises(ValueError, match=message):
        config.check(pp, m)
    with pytest.raises(ValueError, match=message):
        build_schedule(config, pp, m)


# -- the simulator's checks -------------------------------------------------------------------------------

TWO = StagePlacement.looped(2)


def _program(actions: list[list[object]], training: bool = False, m: int = 1) -> PipelineProgram:
    return PipelineProgram("handmade", TWO, m, training, tuple(tuple(a) for a in actions))  # type: ignore[misc]


def _f(stage: int, mb: int = 0) -> Compute:
    return Compute(ComputeKind.FORWARD, stage, mb)


def _act(mb: int = 0) -> Transfer:
    return Transfer(Direction.FORWARD, 0, mb)


def test_waiting_for_a_transfer_posted_after_the_wait_is_a_deadlock() -> None:
    grad = Transfer(Direction.BACKWARD, 1, 0)
    # Rank 1 waits for activations before sending gradients; rank 0 waits for those gradients first.
    program = _program(
        [
            [_f(0), Recv(grad, 1), Compute(ComputeKind.BACKWARD, 0, 0), Send(_act(), 1)],
            [Recv(_act(), 0), _f(1), Compute(ComputeKind.BACKWARD, 1, 0), Send(grad, 0)],
        ],
        training=True,
    )
    with pytest.raises(PipelineDeadlockError, match=r"(?s)ranks \[0, 1\].*rank 0: blocked before B0.0"):
        simulate(program)


def test_channel_order_mismatch_is_rejected() -> None:
    program = _program(
        [
            [_f(0, 0), Send(_act(0), 1), _f(0, 1), Send(_act(1), 1)],
            [Recv(_act(1), 0), Recv(_act(0), 0), _f(1, 0), _f(1, 1)],
        ],
        m=2,
    )
    with pytest.raises(ScheduleError, match="matched in posting order"):
        simulate(program)


def test_unreceived_send_and_missing_passes_are_rejected() -> None:
    with pytest.raises(ScheduleError, match="never receives it"):
        simulate(_program([[_f(0), Send(_act(), 1)], [_f(1)]]))
    with pytest.raises(ScheduleError, match="stage 1 microbatch 0 has 0 forward passes"):
        simulate(_program([[_f(0)], []]))
    with pytest.raises(ScheduleError, match="lives on rank 1"):
        simulate(_program([[_f(0), _f(1)], []]))
    with pytest.raises(ScheduleError, match="expected one full backward"):
        simulate(_program([[_f(0)], [_f(1)]], training=True))


def test_sending_before_computing_is_rejected() -> None:
    program = _program([[Send(_act(), 1), _f(0)], [Recv(_act(), 0), _f(1)]])
    with pytest.raises(ScheduleError, match="before computing what it sends"):
        simulate(program)
