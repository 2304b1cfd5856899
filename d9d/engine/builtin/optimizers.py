"""Built-in optimizer providers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from d9d.optim import PiecewiseScheduleConfig, StochasticAdamW, build_piecewise_lr


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _AdamOptions(_Options):
    """The hyperparameters every Adam-style optimizer here shares."""

    lr: float = Field(3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)


class AdamWProvider:
    class Config(_AdamOptions):
        # Fused kernels where the device supports them (CUDA); the foreach path elsewhere.
        fused: bool | None = None

    def __init__(self, config: Config) -> None:
        self.config = config

    def build(self, parameters: Iterable[nn.Parameter], *, seed: int) -> torch.optim.Optimizer:
        c = self.config
        params = [p for p in parameters if p.requires_grad]
        fused = c.fused if c.fused is not None else bool(params) and params[0].device.type == "cuda"
        return torch.optim.AdamW(
            params, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, fused=fused or None
        )


class SGDProvider:
    class Config(_Options):
        lr: float = Field(1e-2, gt=0)
        momentum: float = Field(0.0, ge=0)
        weight_decay: float = Field(0.0, ge=0)
        nesterov: bool = False

    def __init__(self, config: Config) -> None:
        self.config = config

    def build(self, parameters: Iterable[nn.Parameter], *, seed: int) -> torch.optim.Optimizer:
        c = self.config
        return torch.optim.SGD(
            [p for p in parameters if p.requires_grad],
            lr=c.lr,
            momentum=c.momentum,
            weight_decay=c.weight_decay,
            nesterov=c.nesterov,
        )


class StochasticAdamWProvider:
    """bf16 parameters updated in fp32 and written back with stochastic rounding (d9d.optim)."""

    class Config(_AdamOptions):
        state_dtype: Literal["float32", "bfloat16"] = "float32"
        backend: Literal["auto", "triton", "torch"] = "auto"

    def __init__(self, config: Config) -> None:
        self.config = config

    def build(self, parameters: Iterable[nn.Parameter], *, seed: int) -> torch.optim.Optimizer:
        c = self.config
        return StochasticAdamW(
            [p for p in parameters if p.requires_grad],
            lr=c.lr,
            betas=c.betas,
            eps=c.eps,
            weight_decay=c.weight_decay,
            state_dtype=getattr(torch, c.state_dtype),
            seed=seed % 2**63,
            backend=c.backend,
        )


class PiecewiseLRProvider:
    """Warmup/decay phases as LR multipliers (d9d.optim.lr); see docs/lr_scheduler.md."""

    class Config(PiecewiseScheduleConfig):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def build(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler:
        return build_piecewise_lr(self.config, optimizer, total_steps)

    def check_run(self, total_steps: int) -> None:
        self.config.resolve(total_steps)
