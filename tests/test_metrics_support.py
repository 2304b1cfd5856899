"""Shared fixtures for the metric tests; kept free of scikit-learn so rank processes start fast."""

from __future__ import annotations

import numpy as np
import torch

from d9d.metrics import (
    BinaryAUROC,
    BinaryConfusionMetric,
    ComposeMetric,
    MaxMetric,
    MeanMetric,
    MulticlassConfusionMetric,
    MultilabelConfusionMetric,
    SumMetric,
    to_scalars,
)


def catalogue() -> ComposeMetric:
    return ComposeMetric(
        {
            "loss": MeanMetric(),
            "tokens": SumMetric(),
            "eval": {
                "auroc": BinaryAUROC(num_bins=128),
                "binary": BinaryConfusionMetric(betas=(2.0,)),
                "cls": MulticlassConfusionMetric(num_classes=5, top_k=2),
                "tags": MultilabelConfusionMetric(num_labels=3),
            },
            "peak": MaxMetric(),
        }
    )


def catalogue_inputs(seed: int, n: int = 64) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, 2, (n,), generator=g)
    return {
        "loss": torch.rand(n, generator=g),
        "tokens": torch.tensor(float(n)),
        "eval": {
            "auroc": (torch.rand(n, generator=g), targets),
            "binary": (torch.rand(n, generator=g), targets),
            "cls": (torch.randn(n, 5, generator=g), torch.randint(0, 5, (n,), generator=g)),
            "tags": (torch.rand(n, 3, generator=g), torch.randint(0, 2, (n, 3), generator=g)),
        },
        "peak": torch.randn(n, generator=g),
    }


def assert_trees_close(a: object, b: object) -> None:
    flat_a, flat_b = to_scalars(a), to_scalars(b)
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        np.testing.assert_allclose(flat_a[key], flat_b[key], rtol=1e-12, atol=1e-12, err_msg=key)
