"""Counting token copies per expert without a device-to-host sync (kept here for the modules' imports)."""

from d9d.kernels.moe.permutation import count_per_expert as tokens_per_expert

__all__ = ["tokens_per_expert"]
