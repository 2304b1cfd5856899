"""The MoE token movement as custom ops (`torch.library`), so compiled blocks call them without graph
breaks: each has a fake (shape) implementation and an autograd formula written with the other ops.

- `scatter_rows(x, w, slot_rows, num_rows)`: rows[slot_rows[t, j]] = w[t, j] · x[t] (permute; w optional).
- `gather_sum(rows, w, slot_rows)`: out[t] = Σ_j w[t, j] · rows[slot_rows[t, j]] (combine; w optional).

They are each other's backward; the weight gradient is `slot_dot`. Every output element is written by
one program from values it reads, so results do not depend on scheduling (no atomics).

A negative slot row marks an absent copy (the expert-parallel exchange names only the copies a rank holds):
scatter writes nothing for it, gather adds nothing, and its weight gradient is 0.

Outside a compiled region `permute_tokens` / `combine_tokens` skip the custom-op dispatcher: a plain
`torch.autograd.Function` runs the same kernels with the same backward formula (bitwise the same results).
The eager expert-parallel exchange makes four such calls per layer on a host-bound forward, and the
dispatcher (schema handling, fake-mode checks, autograd wrapping) added 7–150% to each call's host time on
an H200 (`benchmarks/token_ops_host.py`; docs/benchmarks.md, session 19, where the step's tokens per
second did not move beyond the machines' spread).
"""

from __future__ import annotations

from typing import Any

import torch

from d9d.kernels.backend import KernelBackend, resolve_backend
from d9d.kernels.moe.reference import accumulation_dtype, gather_sum_torch, scatter_rows_torch, slot_dot_torch

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _use_triton(backend: str, x: torch.Tensor) -> bool:
    return backend == "triton" and x.dtype in _KERNEL_DTYPES


def _scatter_rows_impl(
    x: torch.Tensor, weights: torch.Tensor | None, slot_rows: torch.Tensor, num_rows: int, backend: str
) -> torch.Tensor:
    if _use_triton(backend, x):
        from d9d.kernels.moe.triton_kernels import scatter_rows_triton

        return scatter_rows_triton(x, weights, slot_rows, num_rows)
    return scatter_rows_torch(x, weights, slot_rows, num_rows)


def _gather_sum_impl(
    rows: torch.Tensor, weights: torch.Tensor | None, slot_rows: torch.Tensor, backend: str
) -> torch.Tensor:
    if _use_triton(backend, rows):
        from d9d.kernels.moe.triton_kernels import gather_sum_triton

        return gather_sum_triton(rows, weights, slot_rows)
    return gather_sum_torch(rows, weights, slot_rows)


def _slot_dot_impl(
    rows: torch.Tensor, grad: torch.Tensor, slot_rows: torch.Tensor, backend: str
) -> torch.Tensor:
    if _use_triton(backend, rows):
        from d9d.kernels.moe.triton_kernels import slot_dot_triton

        return slot_dot_triton(rows, grad, slot_rows)
    return slot_dot_torch(rows, grad, slot_rows)


@torch.library.custom_op("d9d::moe_scatter_rows", mutates_args=())
def _scatter_rows(
    x: torch.Tensor, weights: torch.Tensor | None, slot_rows: torch.Tensor, num_rows: int, backend: str
) -> torch.Tensor:
    return _scatter_rows_impl(x, weights, slot_rows, num_rows, backend)


@_scatter_rows.register_fake
def _(
    x: torch.Tensor, weights: torch.Tensor | None, slot_rows: torch.Tensor, num_rows: int, backend: str
) -> torch.Tensor:
    return x.new_empty(num_rows, x.shape[1])


@torch.library.custom_op("d9d::moe_gather_sum", mutates_args=())
def _gather_sum(
    rows: torch.Tensor, weights: torch.Tensor | None, slot_rows: torch.Tensor, backend: str
) -> torch.Tensor:
    return _gather_sum_impl(rows, weights, slot_rows, backend)


@_gather_sum.register_fake
def _(
    rows: torch.Tensor, weights: torch.Tensor | None, slot_rows: torch.Tensor, backend: str
) -> torch.Tensor:
    return rows.new_empty(slot_rows.shape[0], rows.shape[1])


@torch.library.custom_op("d9d::moe_slot_dot", mutates_args=())
def _slot_dot(rows: torch.Tensor, grad: torch.Tensor, slot_rows: torch.Tensor, backend: str) -> torch.Tensor:
    return _slot_dot_impl(rows, grad, slot_rows, backend)


@_slot_dot.register_fake
def _(rows: torch.Tensor, grad: torch.Tensor, slot_rows: torch.Tensor, backend: str) -> torch.Tensor:
    return rows.new_empty(slot_rows.shape, dtype=accumulation_dtype(rows.dtype))


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor | None, *, eager: bool = False) -> None:
    source, weights, slot_rows = inputs[0], inputs[1], inputs[2]
    ctx.backend = inputs[-1]
    ctx.eager = eager  # the backward calls the implementations directly, or (traced) the custom ops
    ctx.num_source_rows = source.shape[0]
    ctx.save_for_backward(source if weights is not None else None, weights, slot_rows)


def _weight_grad(
    ctx: Any,
    rows: torch.Tensor,
    grad_tokens: torch.Tensor,
    slot_rows: torch.Tensor,
    weights: torch.Tensor | None,
) -> torch.Tensor | None:
    if weights is None or not ctx.needs_input_grad[1]:
        return None
    grad: torch.Tensor = (_slot_dot_impl if ctx.eager else _slot_dot)(
        rows, grad_tokens, slot_rows, ctx.backend
    )
    return grad.to(weights.dtype)


def _scatter_backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weights, slot_rows = ctx.saved_tensors
    gather = _gather_sum_impl if ctx.eager else _gather_sum
    grad_x = gather(grad_rows, weights, slot_rows, ctx.backend) if ctx.needs_input_grad[0] else None
    # ⟨grad_rows[slot], x[t]⟩: the rows operand is the gradient, the per-token operand the input
    grad_w = _weight_grad(ctx, grad_rows, x, slot_rows, weights) if x is not None else None
    return grad_x, grad_w, None, None, None


def _gather_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    rows, weights, slot_rows = ctx.saved_tensors
    scatter = _scatter_rows_impl if ctx.eager else _scatter_rows
    grad_rows = (
        scatter(grad_out, weights, slot_rows, ctx.num_source_rows, ctx.backend)
        if ctx.needs_input_grad[0]
        else None
    )
    grad_w = _weight_grad(ctx, rows, grad_out, slot_rows, weights) if rows is not None else None
    return grad_rows, grad_w, None, None


_scatter_rows.register_autograd(_scatter_backward, setup_context=_setup)
_gather_sum.register_autograd(_gather_backward, setup_context=_setup)


# Old-style Functions (the context as `forward`'s first argument): with a separate `setup_context`,
# `Function.apply` binds the arguments through `inspect.signature` on every call, 16% of the combine's host
# time in the eager exchange on an H200 (py-spy, session 19).
class _EagerScatterRows(torch.autograd.Function):
    """`_scatter_rows` without the custom-op dispatcher, for calls outside a compiled region."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weights: torch.Tensor | None,
        slot_rows: torch.Tensor,
        num_rows: int,
        backend: str,
    ) -> torch.Tensor:
        _setup(ctx, (x, weights, slot_rows, num_rows, backend), None, eager=True)
        return _scatter_rows_impl(x, weights, slot_rows, num_rows, backend)

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _scatter_backward(ctx, grad_rows)


class _EagerGatherSum(torch.autograd.Function):
    """`_gather_sum` without the custom-op dispatcher, for calls outside a compiled region."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, weights: torch.Tensor | None, slot_rows: torch.Tensor, backend: str
    ) -> torch.Tensor:
        _setup(ctx, (rows, weights, slot_rows, backend), None, eager=True)
        return _gather_sum_impl(rows, weights, slot_rows, backend)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _gather_backward(ctx, grad_out)


def permute_tokens(
    x: torch.Tensor,
    slot_rows: torch.Tensor,
    num_rows: int,
    *,
    weights: torch.Tensor | None = None,
    backend: KernelBackend = "auto",
) -> torch.Tensor:
    """`x` [tokens, hidden] → [num_rows, hidden] expert-grouped rows: copy j of token t lands on row
    `slot_rows[t, j]` (times `weights[t, j]` when given; nowhere when the slot is negative); rows no slot
    names are zero. `num_rows == slot_rows.numel()` must mean every slot is present: the Triton path then
    skips clearing the buffer."""
    resolved = resolve_backend(backend, x.device)
    if torch.compiler.is_compiling():
        rows: torch.Tensor = _scatter_rows(x, weights, slot_rows, num_rows, resolved)
    else:
        rows = _EagerScatterRows.apply(x, weights, slot_rows, num_rows, resolved)
    return rows


def combine_tokens(
    rows: torch.Tensor,
    slot_rows: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    backend: KernelBackend = "auto",
) -> torch.Tensor:
    """Expert-grouped `rows` → [tokens, hidden]: token t sums its k rows (times `weights[t, j]` when given),
    skipping negative (absent) slots. A gather per token: deterministic, unlike a scatter-add of rows into
    tokens."""
    resolved = resolve_backend(backend, rows.device)
    if torch.compiler.is_compiling():
        out: torch.Tensor = _gather_sum(rows, weights, slot_rows, resolved)
    else:
        out = _EagerGatherSum.apply(rows, weights, slot_rows, resolved)
    return out
