"""Multiclass classification scores with top-k predictions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from d9d.metrics.classification.confusion import ConfusionMetric
from d9d.metrics.classification.scores import Average, averaged, safe_div


class MulticlassConfusionMetric(ConfusionMetric):
    """One-vs-rest counts per class where a sample "predicts" every class among its top `top_k` scores.

    `update(preds, targets)`: preds are scores `[..., num_classes]` or labels `[...]` (then `top_k` must
    be 1); targets are class indices `[...]`. Samples whose target equals `ignore_index` (e.g. -100 for
    padding tokens) are skipped; other out-of-range targets or labels are invalid and make `compute`
    raise. With `top_k = 1` micro precision, recall, F1 and accuracy coincide.
    """

    def __init__(
        self,
        num_classes: int,
        top_k: int = 1,
        average: Average = "macro",
        betas: Sequence[float] = (),
        ignore_index: int | None = None,
    ) -> None:
        super().__init__(num_classes=num_classes, average=average, betas=betas)
        if not 1 <= top_k <= num_classes:
            raise ValueError(f"MulticlassConfusionMetric: top_k must be in [1, {num_classes}], got {top_k}")
        self.top_k = top_k
        self.ignore_index = ignore_index

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        c = self.num_classes
        if preds.is_floating_point():
            if preds.shape != (*targets.shape, c):
                raise ValueError(
                    f"MulticlassConfusionMetric.update: score preds shape {tuple(preds.shape)} must be "
                    f"targets shape {tuple(targets.shape)} + (num_classes={c},)"
                )
            predicted = preds.detach().to(self.device).reshape(-1, c).topk(self.top_k, dim=-1).indices
        else:
            if self.top_k != 1:
                raise ValueError("MulticlassConfusionMetric.update: label preds need top_k=1; pass scores")
            if preds.shape != targets.shape:
                raise ValueError(
                    f"MulticlassConfusionMetric.update: label preds shape {tuple(preds.shape)} != targets "
                    f"shape {tuple(targets.shape)}"
                )
            predicted = preds.detach().to(self.device).reshape(-1, 1).long()
        target = targets.detach().to(self.device).reshape(-1).long()
        ignored = (
            target == self.ignore_index if self.ignore_index is not None else torch.zeros_like(target).bool()
        )
        in_range = (target >= 0) & (target < c) & ((predicted >= 0) & (predicted < c)).all(-1)
        valid = in_range & ~ignored
        hit = (predicted == target.unsqueeze(-1)).any(-1) & valid

        # Skipped samples land in a trash bin `c`, so counting needs no host sync.
        def count(index: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            return torch.bincount(torch.where(keep, index, c).reshape(-1), minlength=c + 1)[:c]

        tp = count(target, hit)
        predicted_count = count(predicted, valid.unsqueeze(-1).expand_as(predicted))
        support = count(target, valid)
        fp, fn = predicted_count - tp, support - tp
        tn = valid.sum() - tp - fp - fn
        self._add_counts(tp, fp, fn, tn, invalid=(~in_range & ~ignored).sum())

    def accuracy(self, average: Average | None = None) -> torch.Tensor:
        """Fraction of samples whose target is in their top k. Macro: mean over classes that occur in the
        targets (balanced accuracy); "none": per-class recall."""
        tp, _, fn, _ = self.counts()
        support = tp + fn
        per_class = safe_div(tp, support)
        resolved = self._average(average)
        if resolved == "macro":
            seen = support > 0
            return per_class[seen].mean() if bool(seen.any()) else torch.zeros((), dtype=torch.float64)
        return averaged(per_class, tp, support, resolved)
