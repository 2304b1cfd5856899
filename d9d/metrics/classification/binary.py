"""Binary classification scores (positive class = 1)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from d9d.metrics.classification.confusion import ConfusionMetric, binarize, entry_counts


class BinaryConfusionMetric(ConfusionMetric):
    """Accuracy, precision, recall, F-scores of the positive class.

    `update(preds, targets)`: any equal shapes; float preds are scores thresholded with `>= threshold`
    (0.5 for probabilities, 0.0 for logits), integer/bool preds are labels 0/1; targets are 0/1.
    """

    def __init__(self, threshold: float = 0.5, betas: Sequence[float] = ()) -> None:
        super().__init__(num_classes=1, average="micro", betas=betas)
        self.threshold = threshold

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        pred_pos, target_pos, ok = binarize(
            preds.detach().to(self.device), targets.detach().to(self.device), self.threshold, "Binary"
        )
        counts = entry_counts(pred_pos.reshape(-1, 1), target_pos.reshape(-1, 1), ok.reshape(-1))
        self._add_counts(*counts, invalid=(~ok).sum())
