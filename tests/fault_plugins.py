"""User-style plug-ins that inject faults into the real engine, referenced from job files by import path
(`model.provider: tests.fault_plugins:RaisingLMProvider`)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field

from d9d.engine.events import StepStarted
from tests.engine_fixtures import TinyLM, TinyLMProvider, _Opts


class InjectedBackwardError(RuntimeError):
    """What `RaisingLMProvider` raises (a type of the plug-in's own, so a test can tell it apart)."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, message: str) -> torch.Tensor:  # type: ignore[override]
        ctx.message = message
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        raise InjectedBackwardError(ctx.message)


class _FaultyLM(TinyLM):
    def __init__(self, width: int, owner: RaisingLMProvider) -> None:
        super().__init__(width)
        self._owner = owner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(input_ids)
        o = self._owner
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == o.config.fault_rank and o.step in o.config.fault_steps:
            if o.config.kind == "raise_in_backward":
                return _RaiseInBackward.apply(out, f"injected in backward of step {o.step} on rank {rank}")
            if o.config.kind == "sleep_in_forward":
                time.sleep(o.config.sleep_s)
        return out


class RaisingLMProvider(TinyLMProvider):
    """`TinyLMProvider` whose model, on rank `fault_rank` in the steps `fault_steps`, raises in backward
    (`kind: raise_in_backward`, every attempt) or sleeps in forward (`kind: sleep_in_forward`)."""

    class Config(TinyLMProvider.Config):
        fault_rank: int = 1
        fault_steps: list[int] = Field(default_factory=lambda: [3])
        kind: str = "raise_in_backward"
        sleep_s: float = 3600.0

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.step = 0

    def build_stage(self, stage: Any) -> TinyLM:
        return _FaultyLM(self.config.width, self)

    def subscribe(self, events: Any, modules: Any, ctx: Any, metrics: Any) -> None:
        events.subscribe(StepStarted, self._started)

    def _started(self, event: StepStarted) -> None:
        self.step = event.step


__all__ = ["InjectedBackwardError", "RaisingLMProvider", "_Opts"]
