"""One optimizer and one LR scheduler per local stage, stepped together.

A rank holds several stages under interleaved and V schedules. Each stage keeps its own optimizer (built over
its own parameters) and scheduler, so its state travels with the stage: a checkpoint written under one
placement can be loaded under another that puts the stage elsewhere. These wrappers make the set behave as a
single optimizer and scheduler for the training loop; their state dicts are keyed by stage index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

Optimizer = torch.optim.Optimizer
LRScheduler = torch.optim.lr_scheduler.LRScheduler


def _check_stages(kind: str, have: Iterable[int], got: Iterable[str]) -> None:
    mine, theirs = sorted(str(s) for s in have), sorted(got)
    if mine != theirs:
        raise ValueError(f"{kind} state is for stages {theirs}, but this rank holds stages {mine}")


class PipelinedOptimizer:
    def __init__(self, optimizers: Mapping[int, Optimizer]) -> None:
        if not optimizers:
            raise ValueError("PipelinedOptimizer needs at least one stage optimizer")
        self.optimizers = dict(sorted(optimizers.items()))

    @classmethod
    def build(
        cls, stages: Mapping[int, nn.Module], factory: Callable[[Iterable[nn.Parameter]], Optimizer]
    ) -> PipelinedOptimizer:
        """`factory` builds one optimizer over one stage's trainable parameters."""
        return cls({s: factory([p for p in m.parameters() if p.requires_grad]) for s, m in stages.items()})

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every stage's groups, in stage order (the dicts themselves: setting `lr` here sets it there)."""
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {str(s): opt.state_dict() for s, opt in self.optimizers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_stages("optimizer", self.optimizers, state)
        for s, opt in self.optimizers.items():
            opt.load_state_dict(state[str(s)])


class PipelinedLRScheduler:
    def __init__(self, schedulers: Mapping[int, LRScheduler]) -> None:
        if not schedulers:
            raise ValueError("PipelinedLRScheduler needs at least one stage scheduler")
        self.schedulers = dict(sorted(schedulers.items()))

    @classmethod
    def build(
        cls, optimizer: PipelinedOptimizer, factory: Callable[[Optimizer], LRScheduler]
    ) -> PipelinedLRScheduler:
        """`factory` builds one scheduler for one stage's optimizer; all follow the same schedule."""
        return cls({s: factory(opt) for s, opt in optimizer.optimizers.items()})

    def step(self) -> None:
        for scheduler in self.schedulers.values():
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        return [float(lr) for scheduler in self.schedulers.values() for lr in scheduler.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        return {str(s): scheduler.state_dict() for s, scheduler in self.schedulers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_stages("LR scheduler", self.schedulers, state)
        for s, scheduler in self.schedulers.items():
            scheduler.load_state_dict(state[str(s)])
