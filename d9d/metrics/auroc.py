"""Binary AUROC in constant memory: scores are counted into histogram bins instead of being kept.

Exact AUROC needs every score (memory and sync cost grow with the data). Here positives and negatives are
counted per bin over [0, 1]; AUROC is P(score_pos > score_neg) + P(tie) / 2, and pairs in different bins
are ordered exactly, so only pairs sharing a bin can be misjudged, by at most 1/2 each. `error_bound()`
returns that worst case, 0.5 * sum_b pos_b * neg_b / (P * N): the result is within it of the exact
(scikit-learn) AUROC. For scores with bounded densities the bound shrinks like 1/num_bins; scores that
already sit on a grid of `num_bins` bin centres give the exact value.
"""

from __future__ import annotations

import torch

from d9d.metrics.base import Metric


class BinaryAUROC(Metric[torch.Tensor]):
    """Area under the ROC curve for scores in [0, 1] (apply a sigmoid to logits first).

    Out-of-range or NaN scores and targets other than 0/1 are not counted, and `compute` then raises:
    checking while updating would stall a GPU step on a host sync. NaN when one class is absent.
    """

    def __init__(self, num_bins: int = 4096) -> None:
        super().__init__()
        if num_bins < 1:
            raise ValueError(f"BinaryAUROC: num_bins must be >= 1, got {num_bins}")
        self.num_bins = num_bins
        # Row 0 counts negatives, row 1 positives, per score bin.
        self.counts = self.add_state("counts", torch.zeros(2, num_bins, dtype=torch.int64), "sum")
        self.invalid = self.add_state("invalid", torch.zeros((), dtype=torch.int64), "sum")

    def update(self, scores: torch.Tensor, targets: torch.Tensor) -> None:
        if scores.shape != targets.shape:
            raise ValueError(
                f"BinaryAUROC.update: scores shape {tuple(scores.shape)} != targets shape "
                f"{tuple(targets.shape)}"
            )
        scores = scores.detach().to(self.device).reshape(-1)
        targets = targets.detach().to(self.device).reshape(-1)
        valid = (scores >= 0) & (scores <= 1) & ((targets == 0) | (targets == 1))
        bins = (scores.nan_to_num(0.0).clamp(0, 1) * self.num_bins).long().clamp_max(self.num_bins - 1)
        # Invalid entries go to a trash slot past the end so nothing here needs a host sync.
        flat = torch.where(valid, targets.long() * self.num_bins + bins, 2 * self.num_bins)
        self.counts.value += torch.bincount(flat, minlength=2 * self.num_bins + 1)[:-1].view(2, -1)
        self.invalid.value += (~valid).sum()

    def _check(self) -> tuple[torch.Tensor, torch.Tensor]:
        invalid = int(self.invalid.value)
        if invalid:
            raise ValueError(
                f"BinaryAUROC saw {invalid} invalid inputs (scores outside [0, 1] or NaN, or targets not 0/1)"
            )
        counts = self.counts.value.double()
        return counts[0], counts[1]

    def compute(self) -> torch.Tensor:
        neg, pos = self._check()
        neg_below = torch.cumsum(neg, 0) - neg
        return (pos * (neg_below + 0.5 * neg)).sum() / (pos.sum() * neg.sum())

    def error_bound(self) -> torch.Tensor:
        """Largest possible |compute() - exact AUROC| given the counts (pairs tied within a bin)."""
        neg, pos = self._check()
        return 0.5 * (pos * neg).sum() / (pos.sum() * neg.sum())
