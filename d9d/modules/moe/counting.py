"""Counting token copies per expert without a device-to-host sync."""

from __future__ import annotations

import torch


def tokens_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [num_experts] counts of `expert_ids` (any shape). Unlike `torch.bincount`, whose output size
    depends on the data, a scatter into a fixed-size buffer never waits for the GPU."""
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))
