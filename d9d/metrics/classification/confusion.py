"""The shared core of binary, multiclass and multilabel metrics: one 2×2 confusion matrix per class.

Every classification score here is a function of per-class true/false positive/negative counts, and
counts add across batches and ranks, so the state is a single `[num_classes, 2, 2]` integer tensor (the
layout of `sklearn.metrics.multilabel_confusion_matrix`: `[[tn, fp], [fn, tp]]`). Memory is
O(num_classes) whatever the data size, and one all-reduce syncs it.

Invalid inputs (targets out of range, NaN predictions) are counted, not raised on, during `update` so a
GPU step never waits on a host check; `compute` and the score methods raise if any were seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from d9d.metrics.base import Metric
from d9d.metrics.classification.scores import Average, averaged, check_average, fbeta, safe_div


class ConfusionMetric(Metric[dict[str, torch.Tensor]]):
    """Accuracy, precision, recall and F-scores from per-class confusion counts.

    `compute()` returns `accuracy`, `precision`, `recall`, `f1` and one `f{beta}` per extra beta (e.g.
    `f0.5`, `f2`), all averaged as configured; the methods take another `average` for a one-off view.
    """

    def __init__(self, num_classes: int, average: Average = "macro", betas: Sequence[float] = ()) -> None:
        super().__init__()
        owner = type(self).__name__
        if num_classes < 1:
            raise ValueError(f"{owner}: num_classes must be >= 1, got {num_classes}")
        bad = [b for b in betas if not b > 0]
        if bad:
            raise ValueError(f"{owner}: betas must be > 0, got {bad}")
        self.num_classes = num_classes
        self.average = check_average(average, owner)
        self.betas = tuple(betas)
        self.matrix = self.add_state("matrix", torch.zeros(num_classes, 2, 2, dtype=torch.int64), "sum")
        self.invalid = self.add_state("invalid", torch.zeros((), dtype=torch.int64), "sum")

    def _add_counts(
        self, tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor, tn: torch.Tensor, invalid: torch.Tensor
    ) -> None:
        self.matrix.value += torch.stack([tn, fp, fn, tp], dim=-1).view(-1, 2, 2)
        self.invalid.value += invalid

    def confusion_matrix(self) -> torch.Tensor:
        """`[num_classes, 2, 2]` counts `[[tn, fp], [fn, tp]]` per class (one-vs-rest)."""
        invalid = int(self.invalid.value)
        if invalid:
            raise ValueError(f"{type(self).__name__} saw {invalid} invalid inputs; see its docstring")
        return self.matrix.value.clone()

    def counts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-class (tp, fp, fn, tn) as float64."""
        m = self.confusion_matrix().double()
        return m[:, 1, 1], m[:, 0, 1], m[:, 1, 0], m[:, 0, 0]

    def _average(self, average: Average | None) -> Average:
        return self.average if average is None else check_average(average, type(self).__name__)

    def accuracy(self, average: Average | None = None) -> torch.Tensor:
        """Fraction of correct (sample, class) decisions; micro = 1 - Hamming loss."""
        tp, fp, fn, tn = self.counts()
        correct, total = tp + tn, tp + fp + fn + tn
        return averaged(safe_div(correct, total), correct, total, self._average(average))

    def precision(self, average: Average | None = None) -> torch.Tensor:
        tp, fp, _, _ = self.counts()
        return averaged(safe_div(tp, tp + fp), tp, tp + fp, self._average(average))

    def recall(self, average: Average | None = None) -> torch.Tensor:
        tp, _, fn, _ = self.counts()
        return averaged(safe_div(tp, tp + fn), tp, tp + fn, self._average(average))

    def fbeta(self, beta: float, average: Average | None = None) -> torch.Tensor:
        tp, fp, fn, _ = self.counts()
        resolved = self._average(average)
        if resolved == "micro":
            return fbeta(tp.sum(), fp.sum(), fn.sum(), beta)
        per_class = fbeta(tp, fp, fn, beta)
        return per_class.mean() if resolved == "macro" else per_class

    def compute(self) -> dict[str, torch.Tensor]:
        out = {
            "accuracy": self.accuracy(),
            "precision": self.precision(),
            "recall": self.recall(),
            "f1": self.fbeta(1.0),
        }
        for beta in self.betas:
            out[f"f{beta:g}"] = self.fbeta(beta)
        return out


def binarize(
    preds: torch.Tensor, targets: torch.Tensor, threshold: float, owner: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(predicted positive, target positive, entry is valid). Float preds are thresholded (`>=`), integer
    or bool preds must be 0/1; targets must be 0/1."""
    if preds.shape != targets.shape:
        raise ValueError(
            f"{owner}.update: preds shape {tuple(preds.shape)} != targets shape {tuple(targets.shape)}"
        )
    if preds.is_floating_point():
        pred_pos, pred_ok = preds >= threshold, ~preds.isnan()
    else:
        pred_pos, pred_ok = preds == 1, (preds == 0) | (preds == 1)
    target_ok = (targets == 0) | (targets == 1)
    return pred_pos, targets == 1, pred_ok & target_ok


def entry_counts(
    pred_pos: torch.Tensor, target_pos: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-column (tp, fp, fn, tn) of `[n, classes]` boolean decisions, counting rows where `valid`."""
    v = valid.unsqueeze(-1)
    return (
        (pred_pos & target_pos & v).sum(0),
        (pred_pos & ~target_pos & v).sum(0),
        (~pred_pos & target_pos & v).sum(0),
        (~pred_pos & ~target_pos & v).sum(0),
    )
