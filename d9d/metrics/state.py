"""A metric's accumulated state: tensors that know how ranks combine them.

Every metric is a function of a few tensors. Declaring how each one merges across ranks ("sum", "max",
"min", or "cat" for non-additive data) is all the distributed machinery needs: syncing, checkpointing,
device moves and resets are then written once, for every metric, over these holders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Reduction = Literal["sum", "max", "min", "cat"]
REDUCTIONS: tuple[Reduction, ...] = ("sum", "max", "min", "cat")


@dataclass
class MetricState:
    """One state tensor. `value` may be replaced or updated in place; `default` is what `reset` restores."""

    name: str
    value: torch.Tensor
    default: torch.Tensor
    reduction: Reduction

    def reset(self) -> None:
        self.value = self.default.clone()

    def to(self, device: torch.device) -> None:
        self.value = self.value.to(device)
        self.default = self.default.to(device)
