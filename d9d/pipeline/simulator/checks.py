"""Static checks of a program: every action runs on the right rank, every (stage, microbatch) gets exactly the
passes it needs, and every channel between two ranks carries the same transfers in the same order on both
ends.

P2P operations between two ranks are matched in posting order (NCCL ignores tags), so the k-th send from A
to B must be the k-th receive on B from A: otherwise B silently gets the wrong tensor, or waits forever.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from d9d.pipeline.schedule.actions import Compute, ComputeKind, Direction, Recv, Send, Transfer, compute_parts
from d9d.pipeline.schedule.program import PipelineProgram


class ScheduleError(ValueError):
    """A program that cannot run correctly."""


def check_program(program: PipelineProgram) -> None:
    _check_placement_and_coverage(program)
    channel_partners(program)


def _check_placement_and_coverage(program: PipelineProgram) -> None:
    placement = program.placement
    counts: Counter[tuple[ComputeKind, int, int]] = Counter()
    for rank, actions in enumerate(program.actions):
        for action in actions:
            if isinstance(action, Send | Recv):
                _check_endpoints(program, rank, action)
                continue
            for part in compute_parts(action):
                if not 0 <= part.stage < program.num_stages:
                    raise ScheduleError(f"rank {rank}: {part} names stage {part.stage}, outside the pipeline")
                if not 0 <= part.microbatch < program.num_microbatches:
                    raise ScheduleError(f"rank {rank}: {part} names a microbatch outside the step")
                owner = placement.rank_of(part.stage)
                if owner != rank:
                    raise ScheduleError(
                        f"rank {rank} runs {part} but stage {part.stage} lives on rank {owner}"
                    )
                counts[(part.kind, part.stage, part.microbatch)] += 1
    for stage in range(program.num_stages):
        for mb in range(program.num_microbatches):
            _check_passes(program, counts, stage, mb)


def _check_passes(
    program: PipelineProgram, counts: Counter[tuple[ComputeKind, int, int]], stage: int, mb: int
) -> None:
    got = {kind: counts[(kind, stage, mb)] for kind in ComputeKind}
    where = f"stage {stage} microbatch {mb}"
    if got[ComputeKind.FORWARD] != 1:
        raise ScheduleError(f"{where} has {got[ComputeKind.FORWARD]} forward passes, expected 1")
    backward = (got[ComputeKind.BACKWARD], got[ComputeKind.BACKWARD_INPUT], got[ComputeKind.BACKWARD_WEIGHT])
    if not program.training:
        if any(backward):
            raise ScheduleError(f"{where} has backward passes in a forward-only program")
        return
    if backward not in ((1, 0, 0), (0, 1, 1)):
        raise ScheduleError(
            f"{where} has B×{backward[0]}, I×{backward[1]}, W×{backward[2]}: expected one full backward or "
            "one input backward plus one weight backward"
        )


def _check_endpoints(program: PipelineProgram, rank: int, action: Send | Recv) -> None:
    t = action.transfer
    placement = program.placement
    if not (0 <= t.src_stage < program.num_stages and 0 <= t.dst_stage < program.num_stages):
        raise ScheduleError(f"rank {rank}: {action} crosses a stage boundary that does not exist")
    local, remote = (t.src_stage, t.dst_stage) if isinstance(action, Send) else (t.dst_stage, t.src_stage)
    if placement.rank_of(local) != rank or placement.rank_of(remote) != action.peer:
        raise ScheduleError(
            f"rank {rank}: {action} does not match the placement (stage {local} is on rank "
            f"{placement.rank_of(local)}, stage {remote} on rank {placement.rank_of(remote)})"
        )
    if action.peer == rank:
        raise ScheduleError(f"rank {rank}: {action} sends to itself; same-rank stages hand over locally")


def channel_partners(program: PipelineProgram) -> dict[tuple[int, int], tuple[int, int]]:
    """Map each send (rank, action index) to its receive and back, checking that channels agree."""
    sends: dict[tuple[int, int], list[tuple[int, Transfer]]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple[int, Transfer]]] = defaultdict(list)
    for rank, actions in enumerate(program.actions):
        for i, action in enumerate(actions):
            if isinstance(action, Send):
                sends[(rank, action.peer)].append((i, action.transfer))
            elif isinstance(action, Recv):
                recvs[(action.peer, rank)].append((i, action.transfer))
    partners: dict[tuple[int, int], tuple[int, int]] = {}
    for channel in sorted(set(sends) | set(recvs)):
        src, dst = channel
        out, into = sends.get(channel, []), recvs.get(channel, [])
        for k in range(max(len(out), len(into))):
            if k >= len(out):
                raise ScheduleError(f"rank {dst} receives {into[k][1]} from rank {src}, which never sends it")
            if k >= len(into):
                raise ScheduleError(f"rank {src} sends {out[k][1]} to rank {dst}, which never receives it")
            if out[k][1] != into[k][1]:
                raise ScheduleError(
                    f"channel rank {src} -> rank {dst}: transfer #{k} is sent as {out[k][1]} but received as "
                    f"{into[k][1]} (transfers between two ranks are matched in posting order)"
                )
            partners[(src, out[k][0])] = (dst, into[k][0])
            partners[(dst, into[k][0])] = (src, out[k][0])
    return partners


def needs_input(part: Compute, num_stages: int) -> tuple[str, int, int] | None:
    """The tensor a compute part waits for besides its own earlier passes: ("act", s, mb) or ("grad", s,
    mb)."""
    if part.kind is ComputeKind.FORWARD:
        return ("act", part.stage, part.microbatch) if part.stage > 0 else None
    if part.kind in (ComputeKind.BACKWARD, ComputeKind.BACKWARD_INPUT) and part.stage < num_stages - 1:
        return ("grad", part.stage, part.microbatch)
    return None


def delivered(transfer: Transfer) -> tuple[str, int, int]:
    kind = "act" if transfer.direction is Direction.FORWARD else "grad"
    return (kind, transfer.dst_stage, transfer.microbatch)
