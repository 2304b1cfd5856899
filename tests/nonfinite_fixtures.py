"""Plug-ins that inject a NaN or an infinity at a given step, for the non-finite guard's tests.

`PoisonedData` serves the `GlobalIndexData` stream and marks the batches of chosen steps (on chosen data
ranks) with a poison code; `PoisonTask` turns the code into a NaN loss, an infinite loss, or a finite
loss whose gradient is infinite. The poison is part of the data (its position is the provider's state), so
a rollback that skips the batches since the last commit does not meet it again. `drop` leaves batches out
of the stream: the reference run that a skipped or rolled-back run must equal bit for bit.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from d9d.engine.providers import LossOutput
from tests.engine_fixtures import TokenCETask, _Opts, sample_tokens

Poison = Literal["nan", "inf", "grad_inf"]
CODES: dict[str, float] = {"nan": 1.0, "inf": 2.0, "grad_inf": 3.0}


class PoisonedData:
    class Config(_Opts):
        # batch number (1-based: the batch a run without drops trains on at that step) -> poison
        poison: dict[int, Poison] = Field(default_factory=dict)
        # data-parallel ranks whose share of a poisoned batch is poisoned (None: all)
        ranks: list[int] | None = None
        # batch numbers left out of the stream
        drop: list[int] = Field(default_factory=list)

    def __init__(self, config: Config) -> None:
        self.config = config
        self.batch = 0  # batches consumed (including dropped ones)

    def setup(self, setup: Any) -> None:
        self.s = setup

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        s, c = self.s, self.config
        self.batch += 1
        while self.batch in c.drop:
            self.batch += 1
        per_rank = s.global_batch_size // s.dp_size
        base = (self.batch - 1) * s.global_batch_size + s.dp_rank * per_rank
        samples = torch.stack([sample_tokens(base + i) for i in range(per_rank)])
        kind = c.poison.get(self.batch)
        hit = kind is not None and (c.ranks is None or s.dp_rank in c.ranks)
        code = torch.tensor(CODES[kind] if hit and kind is not None else 0.0)
        return [
            {"input_ids": chunk[:, :-1], "labels": chunk[:, 1:], "poison": code}
            for chunk in samples.split(s.microbatch_size)
        ]

    def state_dict(self) -> dict[str, int]:
        return {"batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batch = int(state["batch"])


class _InfiniteGradient(torch.autograd.Function):
    """Identity forward; an infinite gradient backward (a finite loss with a non-finite gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class PoisonTask(TokenCETask):
    def compute_loss(self, outputs: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> LossOutput:
        loss = super().compute_loss(outputs, microbatch)
        code = float(microbatch["poison"])
        if code == CODES["nan"]:
            return LossOutput(loss.loss_sum * float("nan"), loss.weight)
        if code == CODES["inf"]:
            return LossOutput(loss.loss_sum * float("inf"), loss.weight)
        if code == CODES["grad_inf"]:
            return LossOutput(_InfiniteGradient.apply(loss.loss_sum), loss.weight)
        return loss


class _OverflowingSGD(torch.optim.SGD):
    """SGD whose update at `overflow_at` multiplies every weight past the float range (an update that turns
    finite gradients into infinite weights, as a huge LR can)."""

    def __init__(self, params: Any, lr: float, overflow_at: int) -> None:
        super().__init__(params, lr=lr)
        self.overflow_at = overflow_at
        self.updates = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        result = super().step(closure)
        self.updates += 1
        if self.updates == self.overflow_at:
            for group in self.param_groups:
                for p in group["params"]:
                    p.mul_(1e30).mul_(1e30)
        return result


class OverflowingOptimizer:
    class Config(_Opts):
        lr: float = 1e-2
        overflow_at: int = 1

    def __init__(self, config: Config) -> None:
        self.config = config

    def build(self, named_parameters: Any, *, seed: int) -> torch.optim.Optimizer:
        return _OverflowingSGD([p for _, p in named_parameters], self.config.lr, self.config.overflow_at)
