"""Scores from per-class confusion counts, with micro / macro / per-class averaging.

Conventions follow scikit-learn with `zero_division=0`: a ratio whose denominator is 0 is 0, and a macro
average runs over every class, including classes never seen.
"""

from __future__ import annotations

from typing import Literal

import torch

Average = Literal["micro", "macro", "none"]
AVERAGES: tuple[Average, ...] = ("micro", "macro", "none")


def safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


def fbeta(tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor, beta: float) -> torch.Tensor:
    """(1 + b²) tp / ((1 + b²) tp + b² fn + fp): the F-beta of precision and recall, written in counts."""
    b2 = beta * beta
    return safe_div((1 + b2) * tp, (1 + b2) * tp + b2 * fn + fp)


def averaged(ratio: torch.Tensor, num: torch.Tensor, den: torch.Tensor, average: Average) -> torch.Tensor:
    """Reduce a per-class `ratio = num / den`: micro pools the counts, macro means the ratios."""
    if average == "micro":
        return safe_div(num.sum(), den.sum())
    if average == "macro":
        return ratio.mean()
    return ratio


def check_average(average: str, owner: str) -> Average:
    if average not in AVERAGES:
        raise ValueError(f"{owner}: average must be one of {AVERAGES}, got {average!r}")
    return average  # type: ignore[return-value]  # narrowed by the membership test above
