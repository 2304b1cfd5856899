"""Run a program offline: timings per action, deadlock detection, bubbles and activation memory.

Model of a rank: it walks its action list in order. Sends and receives are posted without blocking; a compute
action starts when the rank is free and its inputs are there. Each directed channel between two ranks is a
FIFO of its own (the executor gives every channel its own communicator, so on NCCL a transfer waiting for
its peer never holds back another channel): the k-th transfer completes once both ends have posted it and
transfer k - 1 has completed, plus the communication latency.

When no rank can move and work remains, the program would deadlock on real hardware: the error names what each
rank waits for. Timing never changes whether a program deadlocks, since the order of everything is fixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from d9d.pipeline.schedule.actions import (
    Action,
    Compute,
    ComputeAction,
    ComputeKind,
    Direction,
    Recv,
    Send,
    compute_parts,
)
from d9d.pipeline.schedule.program import PipelineProgram
from d9d.pipeline.simulator.checks import (
    ScheduleError,
    channel_partners,
    check_program,
    delivered,
    needs_input,
)
from d9d.pipeline.simulator.costs import ActionCosts


class PipelineDeadlockError(ScheduleError):
    """The program stalls: some rank waits for something no other rank will ever provide."""


@dataclass(frozen=True)
class TimedAction:
    action: ComputeAction
    start: float
    end: float


@dataclass(frozen=True)
class RankStats:
    rank: int
    busy: float
    idle: float
    bubble_fraction: float
    peak_activations: int
    """Most (stage, microbatch) forward states held at once: from a forward's start until its last
    backward."""


@dataclass(frozen=True)
class SimulationResult:
    program: PipelineProgram
    costs: ActionCosts
    timeline: tuple[tuple[TimedAction, ...], ...]
    makespan: float
    ranks: tuple[RankStats, ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the whole pipeline: idle time of all ranks over ranks × makespan."""
        total = self.makespan * len(self.ranks)
        return sum(r.idle for r in self.ranks) / total if total else 0.0

    @property
    def peak_activations(self) -> int:
        return max(r.peak_activations for r in self.ranks)


@dataclass
class _Rank:
    actions: tuple[Action, ...]
    pc: int = 0
    clock: float = 0.0
    ready: dict[tuple[str, int, int], float] = field(default_factory=dict)
    """Tensors this rank holds: ("act"|"grad", stage, mb) plus its finished passes ("F"|"I"|"W", ...)."""
    timeline: list[TimedAction] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.actions)


@dataclass
class _Channels:
    partners: dict[tuple[int, int], tuple[int, int]]
    posted: dict[tuple[int, int], float] = field(default_factory=dict)
    """(rank, action index) of each posted transfer end -> posting time."""
    done: dict[tuple[int, int], float] = field(default_factory=dict)
    previous: dict[tuple[int, int], tuple[int, int] | None] = field(default_factory=dict)
    """Send end -> the send posted before it on the same channel."""


def simulate(program: PipelineProgram, costs: ActionCosts | None = None) -> SimulationResult:
    costs = costs or ActionCosts()
    check_program(program)
    channels = _Channels(channel_partners(program))
    last_send: dict[tuple[int, int], tuple[int, int]] = {}
    for rank_id, actions in enumerate(program.actions):
        for i, action in enumerate(actions):
            if isinstance(action, Send):
                channels.previous[(rank_id, i)] = last_send.get((rank_id, action.peer))
                last_send[(rank_id, action.peer)] = (rank_id, i)
    ranks = [_Rank(acts) for acts in program.actions]
    while True:
        moved = False
        for rank_id, rank in enumerate(ranks):
            moved |= _advance(program, costs, channels, rank_id, rank)
        moved |= _complete_transfers(ranks, channels, costs)
        if not moved:
            break
    stuck = [r for r, rank in enumerate(ranks) if not rank.finished]
    if stuck:
        raise PipelineDeadlockError(_deadlock_report(program, ranks, stuck, channels))
    return _result(program, costs, ranks)


def _advance(
    program: PipelineProgram, costs: ActionCosts, channels: _Channels, rank_id: int, rank: _Rank
) -> bool:
    moved = False
    while rank.pc < len(rank.actions):
        action = rank.actions[rank.pc]
        if isinstance(action, Send | Recv):
            if isinstance(action, Send) and _produced_key(action) not in rank.ready:
                raise ScheduleError(f"rank {rank_id} posts '{action}' before computing what it sends")
            channels.posted[(rank_id, rank.pc)] = rank.clock
        else:
            start = _ready_time(program, rank, action)
            if start is None:
                return moved
            start = max(rank.clock, start)
            rank.clock = start + costs.of(action)
            rank.timeline.append(TimedAction(action, start, rank.clock))
            for part in compute_parts(action):
                _apply(program, rank_id, rank, part, rank.clock)
        rank.pc += 1
        moved = True
    return moved


def _complete_transfers(ranks: Sequence[_Rank], channels: _Channels, costs: ActionCosts) -> bool:
    moved = False
    for send_end, posted in list(channels.posted.items()):
        rank_id, index = send_end
        if send_end in channels.done or not isinstance(ranks[rank_id].actions[index], Send):
            continue
        recv_end = channels.partners[send_end]
        before = channels.previous[send_end]
        if recv_end not in channels.posted or (before is not None and before not in channels.done):
            continue
        t = max(posted, channels.posted[recv_end], channels.done[before] if before else 0.0)
        t += costs.communication
        channels.done[send_end] = channels.done[recv_end] = t
        recv = ranks[recv_end[0]].actions[recv_end[1]]
        assert isinstance(recv, Recv)
        ranks[recv_end[0]].ready[delivered(recv.transfer)] = t
        moved = True
    return moved


def _produced_key(send: Send) -> tuple[str, int, int]:
    t = send.transfer
    kind = "F" if t.direction is Direction.FORWARD else "I"
    return (kind, t.src_stage, t.microbatch)


def _ready_time(program: PipelineProgram, rank: _Rank, action: ComputeAction) -> float | None:
    start = 0.0
    for part in compute_parts(action):
        for key in _deps(program, part):
            if key not in rank.ready:
                return None
            start = max(start, rank.ready[key])
    return start


def _deps(program: PipelineProgram, part: Compute) -> list[tuple[str, int, int]]:
    s, mb = part.stage, part.microbatch
    deps: list[tuple[str, int, int]] = []
    data = needs_input(part, program.num_stages)
    if data is not None:
        deps.append(data)
    if part.kind in (ComputeKind.BACKWARD, ComputeKind.BACKWARD_INPUT):
        deps.append(("F", s, mb))
    if part.kind is ComputeKind.BACKWARD_WEIGHT:
        deps.append(("I", s, mb))
    return deps


def _apply(program: PipelineProgram, rank_id: int, rank: _Rank, part: Compute, end: float) -> None:
    s, mb = part.stage, part.microbatch
    placement = program.placement
    if part.kind is ComputeKind.FORWARD:
        rank.ready[("F", s, mb)] = end
        if s + 1 < program.num_stages and placement.rank_of(s + 1) == rank_id:
            rank.ready[("act", s + 1, mb)] = end
    elif part.kind in (ComputeKind.BACKWARD, ComputeKind.BACKWARD_INPUT):
        rank.ready[("I", s, mb)] = end
        if part.kind is ComputeKind.BACKWARD:
            rank.ready[("W", s, mb)] = end
        if s > 0 and placement.rank_of(s - 1) == rank_id:
            rank.ready[("grad", s - 1, mb)] = end
    else:
        rank.ready[("W", s, mb)] = end


def _deadlock_report(
    program: PipelineProgram, ranks: Sequence[_Rank], stuck: Sequence[int], channels: _Channels
) -> str:
    lines = [f"{program.name}: deadlock, ranks {list(stuck)} cannot make progress"]
    for r in stuck:
        rank = ranks[r]
        action = rank.actions[rank.pc]
        assert not isinstance(action, Send | Recv)
        missing = [
            key for part in compute_parts(action) for key in _deps(program, part) if key not in rank.ready
        ]
        unmatched = [
            f"'{rank.actions[i]}'"
            for (owner, i) in channels.posted
            if owner == r and (owner, i) not in channels.done
        ]
        line = f"  rank {r}: blocked before {action} waiting for {', '.join(map(_describe_key, missing))}"
        if unmatched:
            line += f"; posted but unmatched: {', '.join(unmatched)}"
        lines.append(line)
    return "\n".join(lines)


def _describe_key(key: tuple[str, int, int]) -> str:
    kind, stage, mb = key
    names = {
        "act": "input activations",
        "grad": "output gradients",
        "F": "its forward",
        "I": "its input backward",
        "W": "its weight backward",
    }
    return f"{names[kind]} of stage {stage} microbatch {mb}"


def _result(program: PipelineProgram, costs: ActionCosts, ranks: Sequence[_Rank]) -> SimulationResult:
    makespan = max((t.end for rank in ranks for t in rank.timeline), default=0.0)
    stats = []
    for r, rank in enumerate(ranks):
        busy = sum(t.end - t.start for t in rank.timeline)
        idle = makespan - busy
        stats.append(
            RankStats(
                rank=r,
                busy=busy,
                idle=idle,
                bubble_fraction=idle / makespan if makespan else 0.0,
                peak_activations=_peak_activations(program, rank.timeline),
            )
        )
    return SimulationResult(
        program=program,
        costs=costs,
        timeline=tuple(tuple(rank.timeline) for rank in ranks),
        makespan=makespan,
        ranks=tuple(stats),
    )


def _peak_activations(program: PipelineProgram, timeline: Sequence[TimedAction]) -> int:
    events: list[tuple[float, int]] = []
    for timed in timeline:
        for part in compute_parts(timed.action):
            if part.kind is ComputeKind.FORWARD:
                events.append((timed.start, 1))
                if not program.training:
                    events.append((timed.end, -1))
            elif part.kind in (ComputeKind.BACKWARD, ComputeKind.BACKWARD_WEIGHT):
                events.append((timed.end, -1))
    peak = current = 0
    for _, delta in sorted(events):  # releases (-1) sort before acquisitions at the same time
        current += delta
        peak = max(peak, current)
    return peak
