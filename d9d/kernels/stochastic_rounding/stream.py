"""Which random bits an update draws: the Philox counter layout shared by the reference and the kernel."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

from d9d.kernels.stochastic_rounding.philox import MASK32, philox_bits16


class Target(IntEnum):
    """Each rounded tensor of one update draws from its own stream."""

    PARAM = 0
    EXP_AVG = 1
    EXP_AVG_SQ = 2


@dataclass(frozen=True)
class RoundingStream:
    """Counter coordinates of one tensor's update.

    Element `i` of the local tensor is numbered `first_index + i`. When a shard is a contiguous range of
    the full tensor, `first_index` is its global offset and `shard` is 0, so every layout (and every
    replica) draws the same bit for the same global element. Other layouts number locally and tell shards
    apart by `shard`.
    """

    seed: int
    step: int
    tensor_index: int
    first_index: int = 0
    shard: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed={self.seed} must be in [0, 2**64)")
        if not 0 <= self.tensor_index <= MASK32:
            raise ValueError(f"tensor_index={self.tensor_index} must fit in 32 bits")
        if not 0 <= self.shard < 2**30:
            raise ValueError(f"shard={self.shard} must be in [0, 2**30)")
        if self.first_index < 0:
            raise ValueError(f"first_index={self.first_index} must be >= 0")

    def counter_tail(self, target: Target) -> tuple[int, int, int]:
        """Philox counter words 1..3 (word 0 numbers the 8-element group)."""
        return self.step & MASK32, self.tensor_index, int(target) | (self.shard << 2)

    def bits16(self, numel: int, target: Target, device: torch.device) -> Tensor:
        return philox_bits16(numel, self.first_index, self.counter_tail(target), self.seed, device)
