"""Several documents in one row, each attending only to itself.

Packing removes padding: short documents share a row instead of each being padded to the longest. The
model must then not let a token attend across a document boundary, and rotary positions must restart at
each document, which is what `position_ids` (restarting at 0) and `document_ids` (for a block-causal mask
or varlen attention kernels) carry.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def plan_packs(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of the sequences per row, filling rows in order (next-fit).

    In order rather than best-fit: the data order (already length-bucketed upstream) is kept, so packing
    is deterministic and a sample's place in the stream stays meaningful for resume.
    """
    if capacity < 1:
        raise ValueError(f"pack capacity={capacity} must be >= 1")
    rows: list[list[int]] = []
    used = capacity  # forces a new row for the first sequence
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sequence {i} has {n} tokens, more than the pack length {capacity}")
        if used + n > capacity:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def pack_sequences(sequences: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate 1-D sequences; return (values, position_ids restarting at 0, document_ids 0..k-1)."""
    if not sequences:
        raise ValueError("pack_sequences needs at least one sequence")
    device = sequences[0].device
    values = torch.cat(list(sequences))
    positions = torch.cat([torch.arange(len(s), device=device) for s in sequences])
    documents = torch.cat(
        [torch.full((len(s),), d, dtype=torch.long, device=device) for d, s in enumerate(sequences)]
    )
    return values, positions, documents


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """`(B, T)` document ids (negative = padding) → `(B, T, T)` boolean mask, True where query t may attend
    key s: same document, s <= t. Padding rows attend nowhere (use `attention_mask` to ignore them)."""
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    real = (document_ids >= 0).unsqueeze(-1)
    t = document_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    return same & real & causal
