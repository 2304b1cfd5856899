"""One process group per directed channel between two pipeline ranks.

On NCCL, P2P operations posted on one communicator run on one stream in posting order, so a send waiting
for its receiver holds back every later operation of the rank on that communicator, including receives from
other peers; schedules such as interleaved 1F1B or DualPipeV then deadlock unless every rank posts its
transfers in a globally consistent lockstep. Giving each direction of each rank pair its own two-rank
communicator leaves only the ordering that matters: transfers on one channel are matched in order. That is
also what gloo does, and what the simulator models. Groups are created collectively by every rank of the
world (each rank creates all groups, in the same order) and used once right away, so that lazily
initialized communicators never block mid-step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from d9d.pipeline.schedule.actions import Send
from d9d.pipeline.schedule.program import PipelineProgram


def pipeline_groups(mesh: DeviceMesh, dim: str = "pp") -> list[list[int]]:
    """Global ranks of every pipeline group of `mesh`, each listed by pipeline rank."""
    names = mesh.mesh_dim_names or ()
    if dim not in names:
        raise ValueError(f"mesh has no dim {dim!r}; its dims are {names}")
    ranks = mesh.mesh.movedim(names.index(dim), -1)
    return [[int(r) for r in row] for row in ranks.reshape(-1, ranks.shape[-1]).tolist()]


def program_channels(program: PipelineProgram) -> list[tuple[int, int]]:
    """(source, destination) pipeline ranks of every channel the program sends on."""
    return sorted(
        {
            (rank, a.peer)
            for rank, actions in enumerate(program.actions)
            for a in actions
            if isinstance(a, Send)
        }
    )


class P2PChannels:
    """The channel groups of this rank's pipeline group, addressed by pipeline ranks."""

    def __init__(self, ranks: Sequence[int], groups: dict[tuple[int, int], dist.ProcessGroup]) -> None:
        self.ranks = list(ranks)
        """Global rank of each pipeline rank of this group."""
        self._groups = groups

    @classmethod
    def create(
        cls,
        all_groups: Sequence[Sequence[int]],
        channels: Iterable[tuple[int, int]],
        device: torch.device,
    ) -> P2PChannels:
        """Collective over the whole world: every rank passes the same `all_groups` and `channels`."""
        me = dist.get_rank()
        channels = sorted(set(channels))
        mine: list[int] | None = None
        groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        for ranks in all_groups:
            for src, dst in channels:
                group = dist.new_group([ranks[src], ranks[dst]])
                if me in ranks:
                    mine = list(ranks)
                    if me in (ranks[src], ranks[dst]):
                        assert group is not None
                        groups[(src, dst)] = group
        if mine is None:
            raise ValueError(f"rank {me} is in none of the pipeline groups {list(map(list, all_groups))}")
        for group in groups.values():  # same global order on both members of every group
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        return cls(mine, groups)

    def op(self, send: bool, tensor: torch.Tensor, me: int, peer: int) -> dist.P2POp:
        """The P2P operation carrying `tensor` between pipeline ranks `me` and `peer`."""
        channel = (me, peer) if send else (peer, me)
        if channel not in self._groups:
            raise KeyError(f"no channel from pipeline rank {channel[0]} to {channel[1]} was created")
        return dist.P2POp(
            dist.isend if send else dist.irecv, tensor, self.ranks[peer], group=self._groups[channel]
        )
