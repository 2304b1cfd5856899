"""Stacking variable-length sequences into one padded tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

PadSide = Literal["left", "right"]


def round_up(length: int, multiple_of: int | None) -> int:
    """`length` rounded up to a multiple (tensor cores and some kernels want multiples of 8/64/128)."""
    if multiple_of is None:
        return length
    if multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={multiple_of} must be >= 1")
    return -(-length // multiple_of) * multiple_of


def pad_stack(
    sequences: Sequence[torch.Tensor],
    pad_value: float,
    *,
    side: PadSide = "right",
    pad_to_multiple_of: int | None = None,
    length: int | None = None,
) -> torch.Tensor:
    """Stack `(L_i, *rest)` tensors into `(B, T, *rest)`, padding dim 0 on `side` with `pad_value`.

    `T` is the longest `L_i` rounded up to `pad_to_multiple_of`, or exactly `length` when given (fixed
    shapes, e.g. for pipeline stages or compiled graphs).
    """
    if not sequences:
        raise ValueError("pad_stack needs at least one sequence")
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r} must be 'left' or 'right'")
    first = sequences[0]
    for i, seq in enumerate(sequences):
        if seq.dim() < 1 or seq.shape[1:] != first.shape[1:] or seq.dtype != first.dtype:
            raise ValueError(
                f"sequence {i} has shape {tuple(seq.shape)} / {seq.dtype}; expected (L, "
                f"{', '.join(map(str, first.shape[1:]))}) / {first.dtype} like sequence 0"
            )
    longest = max(len(s) for s in sequences)
    target = round_up(longest, pad_to_multiple_of) if length is None else length
    if target < longest:
        raise ValueError(f"length={length} is shorter than the longest sequence ({longest})")
    out = torch.full(
        (len(sequences), target, *first.shape[1:]), pad_value, dtype=first.dtype, device=first.device
    )
    for row, seq in zip(out, sequences, strict=True):
        if side == "right":
            row[: len(seq)] = seq
        elif len(seq):
            row[-len(seq) :] = seq
    return out
