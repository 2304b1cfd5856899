"""Multilabel classification scores: each of `num_labels` columns is its own binary decision."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from d9d.metrics.classification.confusion import ConfusionMetric, binarize, entry_counts
from d9d.metrics.classification.scores import Average


class MultilabelConfusionMetric(ConfusionMetric):
    """Per-label counts plus exact-match counts.

    `update(preds, targets)`: shapes `[..., num_labels]`; float preds thresholded with `>= threshold`,
    integer/bool preds and targets 0/1. A sample with any invalid entry is left out entirely (and makes
    `compute` raise). `accuracy` is label-wise (micro = 1 - Hamming loss); `subset_accuracy` is the
    fraction of samples whose every label is right (`sklearn.metrics.accuracy_score`).
    """

    def __init__(
        self,
        num_labels: int,
        threshold: float = 0.5,
        average: Average = "macro",
        betas: Sequence[float] = (),
    ) -> None:
        super().__init__(num_classes=num_labels, average=average, betas=betas)
        self.threshold = threshold
        self.exact = self.add_state("exact", torch.zeros((), dtype=torch.int64), "sum")

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        if preds.dim() == 0 or preds.shape[-1] != self.num_classes:
            raise ValueError(
                f"MultilabelConfusionMetric.update: preds shape {tuple(preds.shape)} must end in "
                f"num_labels={self.num_classes}"
            )
        pred_pos, target_pos, ok = binarize(
            preds.detach().to(self.device), targets.detach().to(self.device), self.threshold, "Multilabel"
        )
        pred_pos = pred_pos.reshape(-1, self.num_classes)
        target_pos = target_pos.reshape(-1, self.num_classes)
        valid = ok.reshape(-1, self.num_classes).all(-1)
        self._add_counts(*entry_counts(pred_pos, target_pos, valid), invalid=(~valid).sum())
        self.exact.value += ((pred_pos == target_pos).all(-1) & valid).sum()

    def subset_accuracy(self) -> torch.Tensor:
        tp, fp, fn, tn = self.counts()
        samples = (tp + fp + fn + tn)[0]
        return self.exact.value.double() / samples if samples > 0 else torch.zeros((), dtype=torch.float64)

    def compute(self) -> dict[str, torch.Tensor]:
        return {**super().compute(), "subset_accuracy": self.subset_accuracy()}
