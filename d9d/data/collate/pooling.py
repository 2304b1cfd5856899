"""Weights that pool token states into one vector per document (embeddings, classification heads)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

PoolingKind = Literal["mean", "first", "last"]


def pooling_weights(document_ids: torch.Tensor, kind: PoolingKind) -> torch.Tensor:
    """`(B, T)` document ids (0..D-1 per row, negative = padding) → `(B, D, T)` float weights, so that
    `weights @ hidden` (`(B, T, H)`) gives one pooled vector per document. Works for packed rows and, with
    `document_ids = attention_mask - 1`, for one padded document per row (left or right padding).

    Rows with fewer than D documents get all-zero weights for the missing ones.
    """
    if kind not in ("mean", "first", "last"):
        raise ValueError(f"pooling kind={kind!r} must be 'mean', 'first' or 'last'")
    num_docs = int(document_ids.max().item()) + 1 if document_ids.numel() else 0
    real = document_ids >= 0
    onehot = F.one_hot(document_ids.clamp(min=0), max(num_docs, 1)).to(torch.float32)
    onehot = (onehot * real.unsqueeze(-1)).transpose(1, 2)  # (B, D, T)
    if kind == "mean":
        return onehot / onehot.sum(-1, keepdim=True).clamp(min=1)
    # First / last token of each document: where the document id changes going backwards / forwards.
    edge = torch.ones_like(real)
    if kind == "last":
        edge[:, :-1] = document_ids[:, :-1] != document_ids[:, 1:]
    else:
        edge[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return onehot * edge.unsqueeze(1)
