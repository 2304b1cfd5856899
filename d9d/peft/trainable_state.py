"""Trainable-only model state: what a checkpoint must keep when the frozen weights come from elsewhere."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


def frozen_parameter_names(module: nn.Module) -> frozenset[str]:
    """Every name (tied aliases included) of a parameter that does not require a gradient."""
    return frozenset(n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad)


def trainable_state_dict(module: nn.Module, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`state` (default `module.state_dict()`) without the frozen parameters. Buffers stay: they may change
    during training (e.g. the MoE expert bias) and cannot be re-derived from the base checkpoint."""
    source: Mapping[str, Any] = module.state_dict() if state is None else state
    frozen = frozen_parameter_names(module)
    return {k: v for k, v in source.items() if k not in frozen}
