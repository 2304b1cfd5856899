"""Vocabulary parallelism: the token embedding and the causal-LM head sharded over vocabulary rows.

Every vocabulary split (`weights.<name>`, [split_size, hidden]) becomes a DTensor `Shard(0)` on the tp
mesh (torch.chunk sizes, so a split need not divide evenly). The modules keep their parameter layout and
state-dict keys; their class is swapped for a subclass whose forward runs on the local rows, the same
device-mesh-aware trick FSDP2 uses.

- Embedding: each rank looks up the ids it owns (zeros elsewhere); the partial rows are all-reduced, so
  the output is replicated (the model derives positions from its shape; sequence parallelism starts at the
  first decoder layer, see `d9d.parallel.plans`).
- Head: hidden states enter a tensor-parallel region (gathered along the sequence under sequence
  parallelism), the loss is `vocab_parallel_cross_entropy`, logits (no labels) are gathered.
A tied head and embedding share the ParameterDict, which is sharded once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from d9d.modules.embedding import TokenEmbedding
from d9d.modules.heads import CausalLMHead
from d9d.modules.heads.linear_cross_entropy import IGNORE_INDEX
from d9d.parallel.tensor.comm import (
    copy_to_group,
    gather_from_group,
    gather_sum_grad,
    reduce_from_group,
)
from d9d.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy


def _shard_splits(weights: nn.ParameterDict, splits: dict[str, int], tp_mesh: DeviceMesh) -> None:
    for name in splits:
        param = weights[name]
        if isinstance(param, DTensor):
            if param.device_mesh != tp_mesh or param.placements != (Shard(0),):
                raise ValueError(f"vocabulary split {name!r} is already distributed as {param.placements}")
            continue  # shared with a tied module that was sharded first
        sharded = distribute_tensor(param.detach(), tp_mesh, [Shard(0)], src_data_rank=None)
        weights[name] = nn.Parameter(sharded, requires_grad=param.requires_grad)


class _VocabShards:
    """Local rows of each split and the global id of their first row."""

    def __init__(self, weights: nn.ParameterDict, splits: dict[str, int], group: dist.ProcessGroup) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.local: list[torch.Tensor] = []
        self.starts: list[int] = []
        self.padded: list[int] = []  # rows per rank before torch.chunk trims the last ranks
        self.sizes: list[int] = []
        offset = 0
        for name, split in splits.items():
            param = weights[name]
            assert isinstance(param, DTensor)
            per_rank = -(-split // size)
            self.local.append(param.to_local())
            self.starts.append(offset + min(rank * per_rank, split))
            self.padded.append(per_rank)
            self.sizes.append(split)
            offset += split


class VocabParallelTokenEmbedding(TokenEmbedding):
    tp_group: dist.ProcessGroup

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        shards = _VocabShards(self.weights, self.splits, self.tp_group)
        out: torch.Tensor | None = None
        for weight, start in zip(shards.local, shards.starts, strict=True):
            if weight.shape[0] == 0:
                # Owning no row of this split: a zero row keeps the (empty) shard in the graph, so every
                # rank ends backward with a gradient for every parameter.
                weight = torch.cat([weight, weight.new_zeros(1, weight.shape[1])])
            local_ids = input_ids - start
            inside = (local_ids >= 0) & (local_ids < weight.shape[0])
            rows = F.embedding(local_ids.clamp(0, weight.shape[0] - 1), weight) * inside[..., None]
            out = rows if out is None else out + rows
        assert out is not None
        return reduce_from_group(out, self.tp_group)


class VocabParallelCausalLMHead(CausalLMHead):
    tp_group: dist.ProcessGroup
    sequence_parallel: bool

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        group = self.tp_group
        hidden = gather_sum_grad(hidden, 1, group) if self.sequence_parallel else copy_to_group(hidden, group)
        shards = _VocabShards(self.weights, self.splits, group)
        if labels is None:
            pieces = []
            for weight, padded, size in zip(shards.local, shards.padded, shards.sizes, strict=True):
                logits = F.pad(hidden @ weight.t(), (0, padded - weight.shape[0]))
                pieces.append(gather_from_group(logits, -1, group)[..., :size])
            return torch.cat(pieces, dim=-1)
        if labels.shape != hidden.shape[:-1]:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} does not match hidden {tuple(hidden.shape[:-1])}"
            )
        losses = vocab_parallel_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            shards.local,
            shards.starts,
            labels.reshape(-1),
            group,
            chunk_size=self.loss_chunk_size,
            ignore_index=IGNORE_INDEX,
        )
        return losses.view(labels.shape)


def parallelize_vocab_embedding(embedding: TokenEmbedding, tp_mesh: DeviceMesh) -> None:
    """Shard the embedding's vocabulary over `tp_mesh`; the output is replicated."""
    _shard_splits(embedding.weights, embedding.splits, tp_mesh)
    embedding.__class__ = VocabParallelTokenEmbedding
    assert isinstance(embedding, VocabParallelTokenEmbedding)
    embedding.tp_group = tp_mesh.get_group()


def parallelize_vocab_head(
    head: CausalLMHead, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False
) -> None:
    """Shard the head's vocabulary over `tp_mesh`; input replicated, or sequence-sharded (dim 1)."""
    _shard_splits(head.weights, head.splits, tp_mesh)
    head.__class__ = VocabParallelCausalLMHead
    assert isinstance(head, VocabParallelCausalLMHead)
    head.tp_group = tp_mesh.get_group()
    head.sequence_parallel = sequence_parallel
