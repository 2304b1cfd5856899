"""Distributed metrics: accumulate locally, sync over a process group (optionally off the step), compute."""

from d9d.metrics.aggregation import MaxMetric, MeanMetric, MinMetric, SumMetric, WeightedMeanMetric
from d9d.metrics.auroc import BinaryAUROC
from d9d.metrics.base import Metric
from d9d.metrics.classification import (
    Average,
    BinaryConfusionMetric,
    ConfusionMetric,
    MulticlassConfusionMetric,
    MultilabelConfusionMetric,
)
from d9d.metrics.collector import AsyncMetricCollector
from d9d.metrics.compose import ComposeMetric, MetricTree
from d9d.metrics.scalars import to_scalars
from d9d.metrics.state import MetricState, Reduction
from d9d.metrics.sync import sync_states

__all__ = [
    "AsyncMetricCollector",
    "Average",
    "BinaryAUROC",
    "BinaryConfusionMetric",
    "ComposeMetric",
    "ConfusionMetric",
    "MaxMetric",
    "MeanMetric",
    "Metric",
    "MetricState",
    "MetricTree",
    "MinMetric",
    "MulticlassConfusionMetric",
    "MultilabelConfusionMetric",
    "Reduction",
    "SumMetric",
    "WeightedMeanMetric",
    "sync_states",
    "to_scalars",
]
