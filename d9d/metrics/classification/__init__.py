"""Classification scores built on per-class confusion counts."""

from d9d.metrics.classification.binary import BinaryConfusionMetric
from d9d.metrics.classification.confusion import ConfusionMetric
from d9d.metrics.classification.multiclass import MulticlassConfusionMetric
from d9d.metrics.classification.multilabel import MultilabelConfusionMetric
from d9d.metrics.classification.scores import Average

__all__ = [
    "Average",
    "BinaryConfusionMetric",
    "ConfusionMetric",
    "MulticlassConfusionMetric",
    "MultilabelConfusionMetric",
]
