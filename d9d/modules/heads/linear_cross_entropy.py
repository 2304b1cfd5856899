"""Cross-entropy of a linear vocabulary projection without materializing the full logits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from d9d.kernels.backend import KernelBackend
from d9d.kernels.cross_entropy import accumulation_dtype, ce_grad, ce_rows

IGNORE_INDEX = -100


def vocab_logits(hidden: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """`hidden @ cat(weights).T` in the model's dtype, for vocabulary splits in id order (the row-wise
    kernels compute in float32 from a chunk of these)."""
    if len(weights) == 1:
        return hidden @ weights[0].t()  # (a one-tensor cat would still copy the whole chunk)
    return torch.cat([hidden @ w.t() for w in weights], dim=-1)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward and backward walk the tokens in chunks: peak extra memory is one chunk's logits (in the
    model's dtype with the Triton row kernels, upcast to float32 on the PyTorch reference).

    With `eager_grads` (a backward will follow) the forward also computes, while it holds each chunk's
    logits, the gradients of the plain sum of the losses. They are the gradients whenever the upstream
    gradient is one number for every token, which autograd shows without a host sync: the backward of a
    `sum()` hands over that number broadcast with stride 0. The backward then only scales them — the head
    costs three vocabulary matmuls per chunk instead of four. Any other upstream gradient (a per-token
    weighting) makes the backward recompute each chunk's logits from the kept log-sum-exp instead.

    Either way one backward call does the work best: a pipeline schedule that splits backward into an input
    and a weight pass would otherwise call it twice (the second time with the forward's gradients released,
    recomputing every chunk's logits: three vocabulary matmuls per chunk, as much as the head's forward).
    `one_call_backward` tells `d9d.pipeline.autograd.split_backward` to compute the head's weight gradients
    in the input pass (read there through the backward node's Function class; no import either way).
    """

    one_call_backward = True

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        ignore_index: int,
        out_shape: torch.Size,
        eager_grads: bool,
        backend: KernelBackend,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        # Allocated in the caller's shape and filled through a flat view: the result is not itself a view,
        # which FSDP2 warns about on a module's output.
        result = torch.empty(out_shape, dtype=accumulation_dtype(hidden.dtype), device=hidden.device)
        losses = result.view(-1)
        lse = torch.empty_like(losses)
        grads = _Gradients(
            hidden,
            weights,
            eager_grads and ctx.needs_input_grad[0],
            [eager_grads and need for need in ctx.needs_input_grad[_WEIGHTS:]],
        )
        ones = torch.ones(min(chunk_size, hidden.shape[0]), dtype=lse.dtype, device=lse.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            h = hidden[start:end]
            logits = vocab_logits(h, weights)
            chunk_labels = labels[start:end]
            lse[start:end], losses[start:end] = ce_rows(logits, chunk_labels, ignore_index, backend)
            if grads.wanted:  # the gradients of the plain sum: every row's upstream gradient is 1
                grad_logits = ce_grad(
                    logits, lse[start:end], chunk_labels, ones[: h.shape[0]], ignore_index, backend
                )
                grads.add(start, h, grad_logits)
        ctx.save_for_backward(hidden, labels, lse, *weights)
        ctx.chunk_size = chunk_size
        ctx.ignore_index = ignore_index
        ctx.backend = backend
        ctx.eager = grads if grads.wanted else None
        return result

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, labels, lse, *weights = ctx.saved_tensors
        eager, ctx.eager = ctx.eager, None
        none = (None,) * (_WEIGHTS - 1)
        if eager is not None and grad_losses.numel() > 0 and not any(grad_losses.stride()):
            scale = grad_losses.reshape(-1)[0]  # every element is this one (stride 0): no sync to know it
            grad_hidden, grad_weights = eager.result(scale)
            return (grad_hidden, *none, *grad_weights)
        grad_losses = grad_losses.reshape(-1)
        grads = _Gradients(hidden, weights, ctx.needs_input_grad[0], ctx.needs_input_grad[_WEIGHTS:])
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end]
            grad_logits = ce_grad(
                vocab_logits(h, weights),
                lse[start:end],
                labels[start:end],
                grad_losses[start:end],
                ctx.ignore_index,
                ctx.backend,
            )
            grads.add(start, h, grad_logits)
        grad_hidden, grad_weights = grads.result()
        return (grad_hidden, *none, *grad_weights)


def _accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`acc += a @ b` where `acc` may be wider than the operands, without rounding the product to the
    operands' dtype first (which would round once per chunk, what the wide accumulator is there to avoid)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        # cuBLAS adds the half-precision product straight into the float32 accumulator (beta = 1): no
        # rounded [vocab, hidden] intermediate and no separate pass over it per chunk (measured ~10 ms of
        # a 185 ms MoE step on an H100 with the separate add)
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


_WEIGHTS = 7  # position of the first weight among `_LinearCrossEntropy.forward`'s inputs


class _Gradients:
    """The head's input and weight gradients, filled chunk by chunk from each chunk's logits gradient
    (by the forward for a summed loss, or by the backward's recomputation)."""

    def __init__(
        self,
        hidden: torch.Tensor,
        weights: Sequence[torch.Tensor],
        need_hidden: bool,
        need_weights: Sequence[bool],
    ) -> None:
        self._hidden_dtype = hidden.dtype
        self._weights = weights
        self._sizes = [w.shape[0] for w in weights]
        self.hidden = torch.empty_like(hidden) if need_hidden else None
        # accumulate in at least float32: summing per-chunk bf16 products would round once per chunk
        self.weights = [
            torch.zeros(w.shape, dtype=accumulation_dtype(w.dtype), device=w.device) if need else None
            for w, need in zip(weights, need_weights, strict=True)
        ]
        self.wanted = need_hidden or any(need_weights)

    def add(self, start: int, h: torch.Tensor, grad_logits: torch.Tensor) -> None:
        parts = grad_logits.split(self._sizes, dim=1)
        for acc, g in zip(self.weights, parts, strict=True):
            if acc is not None:
                _accumulate_product(acc, g.t(), h)
        if self.hidden is not None:  # written in place: no zero-filled chunk and no extra add per chunk
            out = self.hidden[start : start + h.shape[0]]
            torch.mm(parts[0], self._weights[0], out=out)
            for g, w in zip(parts[1:], self._weights[1:], strict=True):
                out.addmm_(g, w)

    def result(
        self, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """The gradients in the parameters' dtypes, times `scale` when given."""

        def finish(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
            if t is None:
                return None
            return (t if scale is None else t * scale).to(dtype)

        grad_weights = [finish(acc, w.dtype) for acc, w in zip(self.weights, self._weights, strict=True)]
        return finish(self.hidden, self._hidden_dtype), grad_weights


def linear_cross_entropy(
    hidden: torch.Tensor,
    weights: Sequence[torch.Tensor],
    labels: torch.Tensor,
    *,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    eager_grads: bool | None = None,
    backend: KernelBackend = "auto",
) -> torch.Tensor:
    """Per-token cross-entropy of `hidden @ cat(weights).T` against `labels` in at least float32, 0 where
    ignored.

    `hidden` [*, dim]; `weights` are the vocabulary splits [split_size, dim] in id order; `labels` [*]
    (already aligned with `hidden`: label t is the target for row t). The result has the shape of `labels`.
    `eager_grads`: compute the gradients of a summed loss in the forward (default: whenever a backward can
    follow); turn it off when the losses are weighted per token, which would make that work wasted.
    `backend`: the row-wise kernels (`d9d.kernels.cross_entropy`; Triton on CUDA by default).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match hidden {tuple(hidden.shape[:-1])}"
        )
    if eager_grads is None:
        eager_grads = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden, *weights))
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    out: torch.Tensor = _LinearCrossEntropy.apply(
        flat_hidden,
        labels.reshape(-1),
        chunk_size,
        ignore_index,
        labels.shape,
        eager_grads,
        backend,
        *weights,
    )
    return out
