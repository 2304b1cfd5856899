"""Differentiable collectives over a tensor-parallel group, for tensors every rank holds locally.

Each is a forward/backward pair that keeps the tensor-parallel invariant: activations the tp ranks hold
in full are identical on all of them and so are their gradients, while partial results (a row-parallel
matmul, one vocabulary shard's contribution) are summed exactly once.

| function                | forward                  | backward                  |
|-------------------------|--------------------------|---------------------------|
| `reduce_from_group`     | all-reduce               | identity                  |
| `copy_to_group`         | identity                 | all-reduce                |
| `split_to_group`        | keep own chunk of `dim`  | all-gather                |
| `gather_from_group`     | all-gather along `dim`   | keep own chunk            |
| `gather_sum_grad`       | all-gather along `dim`   | reduce-scatter            |
| `scatter_sum`           | reduce-scatter           | all-gather along `dim`    |

`copy_to_group` is `d9d.parallel.local_params.sum_gradient` for activations: the same pair, without the copy
that one makes inside a compiled graph (dynamo refuses a custom Function's view output of a DTensor's
`to_local()` view, which is what that one is given; an activation is not).
Chunks are equal: the size of `dim` must be divisible by the group size.

Every collective is torch's functional one, returning a new tensor (`all_reduce_sum`): it traces into a
compiled block's graph, and nothing is reduced in place in a tensor autograd handed over, which inside a
compiled backward on CUDA gave wrong gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from d9d.parallel.local_params import all_reduce_sum


def _chunk(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} does not split evenly over {size} tensor-parallel ranks"
        )
    return x.chunk(size, dim)[dist.get_rank(group)].contiguous()


def _done(x: torch.Tensor) -> torch.Tensor:
    # a functional collective's result; the wait orders the consumer's stream after it (no host sync)
    out: torch.Tensor = funcol.wait_tensor(x)
    return out


def _all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    front = x.movedim(dim, 0).contiguous()
    return _done(funcol.all_gather_tensor(front, 0, group)).movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} does not split evenly over {size} tensor-parallel ranks"
        )
    front = x.movedim(dim, 0).contiguous()
    return _done(funcol.reduce_scatter_tensor(front, "sum", 0, group)).movedim(0, dim)


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_sum(grad, ctx.group), None


class _SplitTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _chunk(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _chunk(grad, ctx.dim, ctx.group), None, None


class _GatherSumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ScatterSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def reduce_from_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out: torch.Tensor = _ReduceFrom.apply(x, group)
    return out


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out: torch.Tensor = _CopyTo.apply(x, group)
    return out


def split_to_group(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    out: torch.Tensor = _SplitTo.apply(x, dim, group)
    return out


def gather_from_group(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    out: torch.Tensor = _GatherFrom.apply(x, dim, group)
    return out


def gather_sum_grad(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    out: torch.Tensor = _GatherSumGrad.apply(x, dim, group)
    return out


def scatter_sum(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of the ranks' `x`, each keeping its own chunk of `dim` (a row-parallel output under sequence
    parallelism)."""
    out: torch.Tensor = _ScatterSum.apply(x, dim, group)
    return out
