"""A compiled schedule: per-rank action lists, plus the placement and microbatch count they were built for."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from d9d.pipeline.schedule.actions import (
    Action,
    Compute,
    ComputeAction,
    ComputeKind,
    Direction,
    Overlapped,
    Recv,
    Send,
    Transfer,
    compute_parts,
)
from d9d.pipeline.schedule.placement import StagePlacement


@dataclass(frozen=True)
class PipelineProgram:
    name: str
    placement: StagePlacement
    num_microbatches: int
    training: bool
    """False for forward-only programs (inference)."""
    actions: tuple[tuple[Action, ...], ...]
    """`actions[rank]`: what that rank executes, in order."""

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def splits_backward(self) -> bool:
        """Whether backward runs as separate input and weight passes (zero-bubble schedules)."""
        return any(
            part.kind is ComputeKind.BACKWARD_INPUT
            for actions in self.actions
            for action in actions
            if isinstance(action, Compute | Overlapped)
            for part in compute_parts(action)
        )

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages


def add_communication(
    orders: Sequence[Sequence[ComputeAction]], placement: StagePlacement
) -> tuple[tuple[Action, ...], ...]:
    """Insert the P2P transfers each rank's compute order needs.

    A send goes right after the action that produces it, and a receive right before the first action that
    consumes it, so receive buffers live no longer than needed. One exception keeps channels consistent:
    transfers from one rank to another are matched in posting order (NCCL has no tags), so when a rank
    consumes a channel's transfers out of the order they were sent, the earlier ones are received together
    with the first one it needs. Neighbouring stages on the same rank hand tensors over locally.
    """
    sends_per_rank = [
        [(i, _send_for(part, rank, placement)) for i, a in enumerate(order) for part in compute_parts(a)]
        for rank, order in enumerate(orders)
    ]
    channel_order: dict[tuple[int, int], list[Transfer]] = {}
    for rank, sends in enumerate(sends_per_rank):
        for _, send in sends:
            if send is not None:
                channel_order.setdefault((rank, send.peer), []).append(send.transfer)
    programs: list[tuple[Action, ...]] = []
    for rank, order in enumerate(orders):
        recv_at = _recv_positions(order, rank, placement, channel_order)
        sends_after: dict[int, list[Send]] = {}
        for i, send in sends_per_rank[rank]:
            if send is not None:
                sends_after.setdefault(i, []).append(send)
        out: list[Action] = []
        for i, action in enumerate(order):
            out.extend(recv_at.get(i, []))
            out.append(action)
            out.extend(sends_after.get(i, []))
        programs.append(tuple(out))
    return tuple(programs)


def _recv_positions(
    order: Sequence[ComputeAction],
    rank: int,
    placement: StagePlacement,
    channel_order: dict[tuple[int, int], list[Transfer]],
) -> dict[int, list[Recv]]:
    """Index of the compute action each receive is posted before (see `add_communication`)."""
    needed_at: dict[Transfer, int] = {}
    for i, action in enumerate(order):
        for part in compute_parts(action):
            recv = _recv_for(part, rank, placement)
            if recv is not None:
                needed_at.setdefault(recv.transfer, i)
    out: dict[int, list[Recv]] = {}
    for (src, dst), transfers in sorted(channel_order.items()):
        if dst != rank:
            continue
        post = len(order)
        positions = []
        for transfer in reversed(transfers):
            post = min(post, needed_at.get(transfer, len(order)))
            positions.append(post)
        for transfer, at in zip(transfers, reversed(positions), strict=True):
            out.setdefault(at, []).append(Recv(transfer, src))
    return out


def _recv_for(part: Compute, rank: int, placement: StagePlacement) -> Recv | None:
    s, mb = part.stage, part.microbatch
    if part.kind is ComputeKind.FORWARD and s > 0 and placement.rank_of(s - 1) != rank:
        return Recv(Transfer(Direction.FORWARD, s - 1, mb), placement.rank_of(s - 1))
    backward = part.kind in (ComputeKind.BACKWARD, ComputeKind.BACKWARD_INPUT)
    if backward and s < placement.num_stages - 1 and placement.rank_of(s + 1) != rank:
        return Recv(Transfer(Direction.BACKWARD, s + 1, mb), placement.rank_of(s + 1))
    return None


def _send_for(part: Compute, rank: int, placement: StagePlacement) -> Send | None:
    s, mb = part.stage, part.microbatch
    if part.kind is ComputeKind.FORWARD and s < placement.num_stages - 1 and placement.rank_of(s + 1) != rank:
        return Send(Transfer(Direction.FORWARD, s, mb), placement.rank_of(s + 1))
    backward = part.kind in (ComputeKind.BACKWARD, ComputeKind.BACKWARD_INPUT)
    if backward and s > 0 and placement.rank_of(s - 1) != rank:
        return Send(Transfer(Direction.BACKWARD, s, mb), placement.rank_of(s - 1))
    return None


def comm_batches(actions: Sequence[Action]) -> Iterator[tuple[int, list[Send | Recv] | ComputeAction]]:
    """Walk a rank's actions, yielding (index, compute action) or (index, maximal run of transfers)."""
    run: list[Send | Recv] = []
    for i, action in enumerate(actions):
        if isinstance(action, Send | Recv):
            run.append(action)
            continue
        if run:
            yield i - len(run), run
            run = []
        yield i, action
    if run:
        yield len(actions) - len(run), run
