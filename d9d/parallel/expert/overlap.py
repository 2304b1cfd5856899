"""An all-to-all in flight: launched now, waited for later, in forward and in backward.

`launch(x, ...)` starts `all_to_all_single` asynchronously and returns the receive buffer with its
`InFlight`; `land(rows, flight)` waits for it and returns the received rows. Whatever the caller queues
between the two runs while the rows travel (on NCCL the collective has its own stream; `Work.wait()` makes
the compute stream wait, not the host). Both are autograd functions whose roles swap in backward: `land`'s
backward *launches* the reverse all-to-all of the gradient and `launch`'s backward waits for it. Autograd
runs ready nodes latest-created first, so the nodes created between the two calls in forward (another
chunk's experts) run in backward between them too, while the gradient travels. Used by the all-to-all
exchange's `overlap_chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(eq=False)
class InFlight:
    """One all-to-all between `launch` and `land`, and in backward its gradient's reverse exchange. It holds
    no tensor with a gradient function (the autograd nodes hold it: no reference cycle)."""

    output_splits: list[int]
    input_splits: list[int]
    group: dist.ProcessGroup
    work: Any = None  # dist.Work of the forward exchange, until `land`
    grad: torch.Tensor | None = field(default=None, repr=False)  # backward: the input gradient's buffer
    grad_work: Any = None  # dist.Work of the backward exchange, until `launch`'s backward


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, flight: InFlight) -> torch.Tensor:
        ctx.flight = flight
        rows = x.new_empty((sum(flight.output_splits), *x.shape[1:]))
        flight.work = dist.all_to_all_single(
            rows,
            x.contiguous(),
            flight.output_splits,
            flight.input_splits,
            group=flight.group,
            async_op=True,
        )
        return rows

    @staticmethod
    def backward(ctx: Any, _grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        # `_land`'s backward launched the reverse exchange from the rows' gradient; it lands here.
        flight: InFlight = ctx.flight
        assert flight.grad_work is not None and flight.grad is not None
        flight.grad_work.wait()
        grad, flight.grad, flight.grad_work = flight.grad, None, None
        return grad, None


class _Land(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, flight: InFlight) -> torch.Tensor:
        ctx.flight = flight
        flight.work.wait()
        flight.work = None
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        flight: InFlight = ctx.flight
        rows_in = sum(flight.input_splits)
        flight.grad = grad.new_empty((rows_in, *grad.shape[1:]))
        flight.grad_work = dist.all_to_all_single(
            flight.grad,
            grad.contiguous(),
            flight.input_splits,
            flight.output_splits,
            group=flight.group,
            async_op=True,
        )
        # The gradient of the rows as they are; `_Launch.backward` returns the exchanged one.
        return grad, None


def launch(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> tuple[torch.Tensor, InFlight]:
    """Start sending `x`'s rows (`input_splits` to each peer) and receiving `output_splits` from each.
    Returns the receive buffer, differentiable, for `land` only (it is filled when `land` returns)."""
    flight = InFlight(output_splits, input_splits, group)
    rows: torch.Tensor = _Launch.apply(x, flight)
    return rows, flight


def land(rows: torch.Tensor, flight: InFlight) -> torch.Tensor:
    """Wait for `flight` and return its received rows (`rows` is what `launch` returned)."""
    out: torch.Tensor = _Land.apply(rows, flight)
    return out
