"""Cross-entropy of a linear vocabulary projection without materializing the full logits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

IGNORE_INDEX = -100


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    logits = torch.cat([hidden @ w.t() for w in weights], dim=-1)
    return logits.to(_accumulation_dtype(logits.dtype))


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward and backward walk the tokens in chunks: peak extra memory is one chunk's logits, upcast to
    at least float32.

    Only the per-token log-sum-exp is kept for backward, which recomputes each chunk's logits (one extra
    vocabulary matmul per chunk, the price of never holding [tokens, vocab] in float32).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        ignore_index: int,
        out_shape: torch.Size,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        # Allocated in the caller's shape and filled through a flat view: the result is not itself a view,
        # which FSDP2 warns about on a module's output.
        result = torch.empty(out_shape, dtype=_accumulation_dtype(hidden.dtype), device=hidden.device)
        losses = result.view(-1)
        lse = torch.empty_like(losses)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = _chunk_logits(hidden[start:end], weights)
            chunk_labels = labels[start:end]
            valid = chunk_labels != ignore_index
            chunk_lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, chunk_labels.clamp(min=0)[:, None]).squeeze(1)
            losses[start:end] = torch.where(valid, chunk_lse - target, 0.0)
            lse[start:end] = chunk_lse
        ctx.save_for_backward(hidden, labels, lse, *weights)
        ctx.chunk_size = chunk_size
        ctx.ignore_index = ignore_index
        return result

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, labels, lse, *weights = ctx.saved_tensors
        grad_losses = grad_losses.reshape(-1)
        need_hidden = ctx.needs_input_grad[0]
        need_weights = ctx.needs_input_grad[5:]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # accumulate in at least float32: summing per-chunk bf16 products would round once per chunk
        grad_weights = [
            torch.zeros(w.shape, dtype=_accumulation_dtype(w.dtype), device=w.device) if need else None
            for w, need in zip(weights, need_weights, strict=True)
        ]
        sizes = [w.shape[0] for w in weights]
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end]
            chunk_labels = labels[start:end]
            valid = chunk_labels != ctx.ignore_index
            probs = torch.exp(_chunk_logits(h, weights) - lse[start:end, None])
            rows = torch.arange(h.shape[0], device=h.device)
            probs[rows, chunk_labels.clamp(min=0)] -= 1.0
            probs *= torch.where(valid, grad_losses[start:end], 0.0)[:, None]
            grad_logits = probs.to(h.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = sum(
                    (g @ w for g, w in zip(grad_logits.split(sizes, dim=1), weights, strict=True)),
                    torch.zeros_like(h),
                )
            for acc, g in zip(grad_weights, grad_logits.split(sizes, dim=1), strict=True):
                if acc is not None:
                    acc += g.t() @ h
        out_weights = [
            acc.to(w.dtype) if acc is not None else None for acc, w in zip(grad_weights, weights, strict=True)
        ]
        return (grad_hidden, None, None, None, None, *out_weights)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weights: Sequence[torch.Tensor],
    labels: torch.Tensor,
    *,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token cross-entropy of `hidden @ cat(weights).T` against `labels` in at least float32, 0 where
    ignored.

    `hidden` [*, dim]; `weights` are the vocabulary splits [split_size, dim] in id order; `labels` [*]
    (already aligned with `hidden`: label t is the target for row t). The result has the shape of `labels`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match hidden {tuple(hidden.shape[:-1])}"
        )
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    out: torch.Tensor = _LinearCrossEntropy.apply(
        flat_hidden, labels.reshape(-1), chunk_size, ignore_index, labels.shape, *weights
    )
    return out
