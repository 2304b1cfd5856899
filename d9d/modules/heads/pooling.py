"""Reducing a sequence of hidden states to one vector per sample."""

from __future__ import annotations

from typing import Literal

import torch

Pooling = Literal["first", "last", "mean"]


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, mode: Pooling) -> torch.Tensor:
    """`hidden` [batch, seq, dim] → [batch, dim]; `attention_mask` [batch, seq] marks real tokens.

    `last` takes the right-most real token (works for left and right padding), `first` the left-most,
    `mean` averages the real tokens.
    """
    batch, seq, _ = hidden.shape
    mask = (
        attention_mask.bool()
        if attention_mask is not None
        else torch.ones(batch, seq, dtype=torch.bool, device=hidden.device)
    )
    rows = torch.arange(batch, device=hidden.device)
    positions = torch.arange(seq, device=hidden.device).expand(batch, seq)
    if mode == "last":
        return hidden[rows, torch.where(mask, positions, -1).argmax(-1)]
    if mode == "first":
        return hidden[rows, torch.where(mask, positions, seq).argmin(-1)]
    weights = mask.to(hidden.dtype)[..., None]
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
