"""How a sequence is split over the context-parallel ranks: load-balanced causal chunks.

The sequence is cut into `2·cp` equal chunks and rank `r` holds chunks `r` and `2·cp − 1 − r`. Under a
causal mask a query at position p attends to p + 1 keys, so the chunk pairs (early, late) give every rank
the same number of query-key pairs; contiguous halves would leave the first rank nearly idle and the last
one doing most of the work.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain


def check_sequence_length(seq_len: int, cp_size: int) -> None:
    """Raise unless `seq_len` splits into `2·cp_size` equal chunks."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"context parallelism over {cp_size} ranks cuts each sequence into 2·{cp_size} = {2 * cp_size} "
            f"equal chunks, but the sequence length {seq_len} is not divisible by {2 * cp_size} (pad the "
            "batches to a multiple of it, e.g. data.options.pad_to_multiple_of)"
        )


def load_balanced_index(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """Global positions held by `cp_rank`, in local order: chunk `cp_rank`, then chunk
    `2·cp_size − 1 − cp_rank`."""
    check_sequence_length(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    early = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    late_start = (2 * cp_size - 1 - cp_rank) * chunk
    late = torch.arange(late_start, late_start + chunk, device=device)
    return torch.cat((early, late))


def gathered_order(seq_len: int, cp_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Index that puts the rank-major concatenation of every rank's shard back into sequence order:
    `full = gathered.index_select(dim, gathered_order(...))`. Cached: every layer asks, twice (k and v)."""
    return _gathered_order(
        seq_len, cp_size, torch.device(device) if device is not None else torch.device("cpu")
    )


@functools.lru_cache(maxsize=64)
def _gathered_order(seq_len: int, cp_size: int, device: torch.device) -> torch.Tensor:
    held = torch.cat([load_balanced_index(seq_len, cp_size, r, device) for r in range(cp_size)])
    return torch.argsort(held)


@dataclass(frozen=True)
class ContextParallelGroup:
    """The ranks that split one sequence, and this rank's place among them."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def from_context(cls, ctx: DistributedContext) -> ContextParallelGroup:
        """The `cp` dim of the regular domain (context_parallel_replicate × context_parallel_shard: both
        split the sequence; they differ only in how the dense weights are sharded)."""
        mesh = ctx.mesh_for(MeshDomain.REGULAR)["cp"]
        return cls(group=mesh.get_group(), size=mesh.size(), rank=ctx.coordinates(MeshDomain.REGULAR)["cp"])

    def index(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """This rank's global positions for a sequence of `seq_len` tokens."""
        return load_balanced_index(seq_len, self.size, self.rank, device)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x` along `dim` (the full sequence)."""
        return x.index_select(dim, self.index(x.shape[dim], x.device))

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's shard along `dim`, in sequence order; no autograd (masks,
        test and evaluation helpers). `gather_sequence` is the differentiable one."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        gathered = torch.cat(parts, dim)
        return gathered.index_select(dim, gathered_order(gathered.shape[dim], self.size, x.device))
