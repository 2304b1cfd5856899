"""Built-in optimizer providers."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AdamWProvider:
    class Config(_Options):
        lr: float = Field(3e-4, gt=0)
        betas: tuple[float, float] = (0.9, 0.95)
        eps: float = Field(1e-8, gt=0)
        weight_decay: float = Field(0.1, ge=0)
        # Fused kernels where the device supports them (CUDA); the foreach path elsewhere.
        fused: bool | None = None

    def __init__(self, config: Config) -> None:
        self.config = config

    def build(self, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
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

    def build(self, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        c = self.config
        return torch.optim.SGD(
            [p for p in parameters if p.requires_grad],
            lr=c.lr,
            momentum=c.momentum,
            weight_decay=c.weight_decay,
            nesterov=c.nesterov,
        )
