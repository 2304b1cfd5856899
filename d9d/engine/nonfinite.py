"""The non-finite guard: a step whose loss or gradient norm is NaN or infinite never updates the weights,
and a checkpoint whose weights are not finite is never committed (docs/engine.md, "Non-finite steps").

The check is fused into the one host read a step already makes: the global loss sum, the global loss
weight and the global gradient norm (all identical on every rank, so every rank takes the same decision
without another collective) come back to the host together (`StepValuesRead`). Only on the failure path
do the ranks exchange which of them saw the problem first (`attribute`), so the error names the step and
the rank.

`trainer.on_nonfinite` says what happens then: `stop` (the default) raises `NonFiniteError`, `skip` drops
the update (parameters and optimizer state stay bitwise what they were; the step still counts and its
batches are consumed), `rollback` restores the newest commit and skips the batches since it. Both
tolerate `trainer.max_nonfinite_steps` such steps per launch attempt, then stop.

With fused Adam/AdamW (the default on CUDA) the update is queued before the host has the values and skips
itself on the device when they are not finite (`PipelinedOptimizer.step(skip_if=...)`, the fused kernels'
`found_inf`): parameters, moments and step counts stay bitwise what they were, as when the host skips it.
Other optimizers, and the first step (which creates the optimizer state), are stepped by the host after the
read, only when the values are finite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.core.context import DistributedContext
from d9d.core.dist_ops import all_gather_object
from d9d.core.host_copy import HostCopy


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm, or the weights about to be saved, are not finite. Running the attempt
    again from the last commit would repeat it, so launchers do not retry it."""

    def __init__(self, message: str, step: int, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = tuple(ranks)


@dataclass(frozen=True)
class StepValues:
    """A step's global loss sum, loss weight and gradient norm, read to the host in one transfer, and
    whether an expert exchange overflowed its static capacity on any rank (`d9d.engine.exchange`)."""

    loss_sum: float
    weight: float
    grad_norm: float
    exchange_overflow: bool = False

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss_sum) and math.isfinite(self.grad_norm)


class StepValuesRead:
    """The step's values on their way to the host, and the non-finite flag on the device.

    Started before the optimizer step is queued, so the host can queue it while the values travel, and
    waited for after: the host blocks only until the values exist (the end of backward and the gradient
    norm), not until the optimizer has run. A fused optimizer takes `nonfinite` as its skip flag
    (`PipelinedOptimizer.step(skip_if=...)`), so whether the update applies is decided on the device from the
    same two values the host decides from.
    """

    def __init__(self, totals: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """`totals`: the global [loss sum, weight] or [loss sum, weight, ranks whose exchange overflowed]
        (`d9d.engine.step.global_loss`)."""
        totals = totals.double().flatten()
        values = torch.cat([totals[:2], grad_norm.to(totals.device, torch.float64).reshape(1), totals[2:]])
        # The same rule as `StepValues.finite`: the loss sum and the gradient norm.
        self.nonfinite = (~torch.isfinite(values[0::2])).any().to(torch.float32)
        # the update a fused optimizer skips on the device: non-finite, or computed from an overflowed
        # exchange (the step runs again)
        self.skip = (
            self.nonfinite
            if totals.numel() == 2
            else torch.maximum(self.nonfinite, (values[3] > 0).to(torch.float32))
        )
        # queued, not waited for: the optimizer's kernels queued after it do not delay the read
        self._host = HostCopy(values)

    def wait(self) -> StepValues:
        loss_sum, weight, norm, *overflow = self._host.wait().tolist()
        return StepValues(loss_sum, weight, norm, bool(overflow and overflow[0] > 0))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _first_nonfinite(named: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """The name of the first tensor holding a NaN or an infinity (a failure-path scan, one sync each)."""
    for name, tensor in named:
        if tensor is not None and tensor.numel() > 0 and not bool(torch.isfinite(_local(tensor)).all()):
            return name
    return None


@dataclass(frozen=True)
class RankReport:
    rank: int
    loss_finite: bool
    grad: str | None  # the first parameter whose local gradient is not finite


def attribute(
    ctx: DistributedContext, local_loss: torch.Tensor, modules: Sequence[nn.Module]
) -> list[RankReport]:
    """Every rank's view of a non-finite step (a collective; only on the failure path)."""
    grads = ((name, p.grad) for m in modules for name, p in m.named_parameters())
    mine = RankReport(ctx.rank, bool(torch.isfinite(local_loss).all()), _first_nonfinite(grads))
    return all_gather_object(mine) if ctx.is_distributed else [mine]


def describe(step: int, values: StepValues, reports: Sequence[RankReport]) -> tuple[str, list[int]]:
    """`step N: non-finite loss (nan) on rank 1 ...`, and the ranks named (where it showed first)."""
    parts = []
    ranks = [r.rank for r in reports if not r.loss_finite]
    if not math.isfinite(values.loss_sum):
        where = f"on rank {_ranks(ranks)}" if ranks else "in the sum over ranks"
        parts.append(f"non-finite loss ({values.loss_sum}) {where}")
    if not math.isfinite(values.grad_norm):
        grad_ranks = [r for r in reports if r.grad is not None]
        text = f"non-finite gradient norm ({values.grad_norm})"
        if grad_ranks:
            first = grad_ranks[0]
            text += f", first in {first.grad} on rank {_ranks([r.rank for r in grad_ranks])}"
        parts.append(text)
        if not ranks:
            ranks = [r.rank for r in grad_ranks]
    return f"step {step}: " + "; ".join(parts), ranks


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]} (and {len(ranks) - 1} more)"


def check_weights_finite(ctx: DistributedContext, modules: Sequence[nn.Module], step: int) -> None:
    """Raise `NonFiniteError` when any rank's parameters hold a NaN or an infinity (a collective: every
    rank calls it at the same save). One `isfinite` pass per parameter and one host read per save."""
    local = [_local(p.detach()) for m in modules for p in m.parameters() if p.numel() > 0]
    flags = [torch.isfinite(t).all() for t in local]
    ok = bool(torch.stack(flags).all()) if flags else True
    bad = None if ok else _first_nonfinite((n, p) for m in modules for n, p in m.named_parameters())
    reports = all_gather_object((ctx.rank, bad)) if ctx.is_distributed else [(ctx.rank, bad)]
    culprits = [(rank, name) for rank, name in reports if name is not None]
    if culprits:
        name = culprits[0][1]
        ranks = [r for r, _ in culprits]
        raise NonFiniteError(
            f"step {step}: the weights are not finite ({name} on rank {_ranks(ranks)}); the checkpoint is "
            "not written, the newest commit stays the one to resume from",
            step,
            ranks,
        )
