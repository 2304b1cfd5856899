"""Cross-entropy of a vocabulary-parallel linear head, without gathering the logits.

Each tensor-parallel rank holds some rows of the vocabulary projection. Per chunk of tokens a rank
computes its local logits and keeps two numbers per token: the log-sum-exp over its own columns and, on
the one rank owning it, the target logit. One all-reduce SUM per call after the chunk loop combines them
(the global normalizer is the log-sum-exp of the ranks' log-sum-exps), so the collective count does not
grow with the number of chunks (it was a MAX and a SUM all-reduce per chunk: 32 per microbatch of 16k
tokens at chunk 1024).
Backward recomputes the local logits (like the single-device chunked head) and returns this rank's
*partial* gradient for the hidden states: the caller's tensor-parallel region (`sum_gradient` or
`gather_sum_grad`) sums it over the group exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from d9d.kernels.cross_entropy import accumulation_dtype
from d9d.modules.heads.linear_cross_entropy import IGNORE_INDEX, vocab_logits
from d9d.parallel.local_params import all_reduce_sum


def _local_logits(hidden: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """This rank's logit columns in at least float32, like the single-device head's reference."""
    dtype = accumulation_dtype(hidden.dtype)
    if not weights:
        return hidden.new_zeros(hidden.shape[0], 0, dtype=dtype)
    return vocab_logits(hidden, weights).to(dtype)


def _target_columns(labels: torch.Tensor, starts: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """Local logit column of each label, -1 where the label lives on another rank (or is ignored)."""
    column = torch.full_like(labels, -1)
    offset = 0
    for start, size in zip(starts, sizes, strict=True):
        inside = (labels >= start) & (labels < start + size)
        column = torch.where(inside, labels - start + offset, column)
        offset += size
    return column


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        starts: Sequence[int],
        group: dist.ProcessGroup,
        chunk_size: int,
        ignore_index: int,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        sizes = [w.shape[0] for w in weights]
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        # Row r holds rank r's log-sum-exp over its own columns, the last row the target logit (from the
        # one rank owning it); other ranks' rows stay 0, so one SUM all-reduce after the chunk loop gathers
        # everything, instead of a MAX and a SUM per chunk (two collectives per chunk, on the critical path
        # of every chunk's loss).
        stats = torch.zeros(
            size + 1, hidden.shape[0], dtype=accumulation_dtype(hidden.dtype), device=hidden.device
        )
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = _local_logits(hidden[start:end], weights)
            if logits.shape[1]:
                stats[rank, start:end] = torch.logsumexp(logits, dim=-1)
                column = _target_columns(labels[start:end], starts, sizes)
                stats[size, start:end] = torch.where(
                    column >= 0, logits.gather(1, column.clamp(min=0)[:, None]).squeeze(1), 0.0
                )
            else:  # owning no column: contributes nothing to the normalizer
                stats[rank, start:end] = float("-inf")
        stats = all_reduce_sum(stats, group)
        lse = torch.logsumexp(stats[:size], dim=0)
        losses = torch.where(labels != ignore_index, lse - stats[size], 0.0)
        ctx.save_for_backward(hidden, labels, lse, *weights)
        ctx.starts, ctx.sizes = starts, sizes
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, labels, lse, *weights = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden)
        grad_weights = [
            torch.zeros(w.shape, dtype=accumulation_dtype(w.dtype), device=w.device) for w in weights
        ]
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end]
            chunk_labels = labels[start:end]
            probs = torch.exp(_local_logits(h, weights) - lse[start:end, None])
            column = _target_columns(chunk_labels, ctx.starts, ctx.sizes)
            # minus one at the target column where this rank owns it (adding -0.0 elsewhere leaves the row
            # exactly as it was); a scatter, not boolean indexing, whose `nonzero` waited on the GPU every
            # chunk (16 host syncs per step at TP 2 on the benchmark's batch, 57-70 ms of the step)
            owned = (column >= 0).to(probs.dtype)[:, None]
            probs.scatter_add_(1, column.clamp(min=0)[:, None], -owned)
            probs *= torch.where(chunk_labels != ctx.ignore_index, grad_losses[start:end], 0.0)[:, None]
            grad_logits = probs.to(h.dtype)
            for i, (g, w) in enumerate(zip(grad_logits.split(ctx.sizes, dim=1), weights, strict=True)):
                grad_hidden[start:end] += g @ w
                grad_weights[i] += (g.t() @ h).to(grad_weights[i].dtype)
        out_weights = [g.to(w.dtype) for g, w in zip(grad_weights, weights, strict=True)]
        return (grad_hidden, None, None, None, None, None, *out_weights)


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weights: Sequence[torch.Tensor],
    starts: Sequence[int],
    labels: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token loss (at least float32, 0 where ignored) of `hidden @ vocab.T` against global `labels`.

    `weights` are this rank's vocabulary rows, one tensor per piece, piece i holding global ids
    `[starts[i], starts[i] + weights[i].shape[0])`; together the ranks of `group` hold every id once.
    `hidden` [tokens, dim] must be identical on all ranks; its gradient comes back partial (see module doc).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if len(weights) != len(starts):
        raise ValueError(f"{len(weights)} weight pieces but {len(starts)} start offsets")
    out: torch.Tensor = _VocabParallelCrossEntropy.apply(
        hidden, labels, list(starts), group, chunk_size, ignore_index, *weights
    )
    return out
