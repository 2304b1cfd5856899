"""Regional `torch.compile`: each decoder block (and optionally the loss head) compiled once for all
layers, after parallelization.

INTERFACE STUB — the engine calls `compile_stage` after a stage is parallelized and materialized; the
implementation lands with the compile work (issue 15).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

CompileRegion = Literal["decoder_blocks", "loss_head"]


class CompileConfig(BaseModel):
    """The job's `compile:` section. `enabled: null` means on for CUDA, off elsewhere."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool | None = None
    mode: Literal["default", "max-autotune-no-cudagraphs"] = "default"
    regions: tuple[CompileRegion, ...] = ("decoder_blocks", "loss_head")


@dataclass(frozen=True)
class CompileReport:
    """What `compile_stage` did, for the run's log."""

    enabled: bool
    regions: tuple[str, ...]
    reason: str


def compile_enabled(config: CompileConfig, device: torch.device) -> bool:
    return config.enabled if config.enabled is not None else device.type == "cuda"


def compile_stage(stage: nn.Module, config: CompileConfig, device: torch.device) -> CompileReport:
    """Compiles the stage's regions in place (stub: compiles nothing yet)."""
    del stage
    return CompileReport(enabled=False, regions=(), reason=f"not implemented yet (device {device})")
