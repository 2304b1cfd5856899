"""`ComposeMetric`: a nested dict of metrics that updates, syncs, computes and checkpoints as one.

Syncing the whole tree at once matters: all leaves' states join the same flat buffers, so a dozen metrics
cost one or two collectives instead of a dozen.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Self, TypeAlias

import torch

from d9d.metrics.base import Metric
from d9d.metrics.state import MetricState

MetricTree: TypeAlias = Metric[Any] | Mapping[str, "MetricTree"]


class ComposeMetric(Metric[dict[str, Any]]):
    """Children by name; plain nested dicts become nested `ComposeMetric`s.

    `update(inputs)` routes `inputs[name]` to child `name`: a tuple is unpacked as positional arguments,
    anything else is passed as the single argument, a nested compose gets the nested mapping. Names
    missing from `inputs` are not updated. For keyword arguments, update the child directly:
    `metrics["acc"].update(preds=..., targets=...)`. State-dict keys are dotted paths (`"val.acc.matrix"`).
    """

    def __init__(self, metrics: Mapping[str, MetricTree]) -> None:
        super().__init__()
        self._children: dict[str, Metric[Any]] = {}
        for name, child in metrics.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"ComposeMetric: metric name {name!r} must be a non-empty str without '.'")
            if isinstance(child, Mapping):
                child = ComposeMetric(child)
            if not isinstance(child, Metric):
                raise TypeError(f"ComposeMetric: {name!r} is a {type(child).__name__}, not a Metric or dict")
            self._children[name] = child

    def __getitem__(self, name: str) -> Metric[Any]:
        if name not in self._children:
            raise KeyError(f"ComposeMetric has no metric {name!r}; it has {sorted(self._children)}")
        return self._children[name]

    def __contains__(self, name: object) -> bool:
        return name in self._children

    def items(self) -> Iterator[tuple[str, Metric[Any]]]:
        yield from self._children.items()

    def update(self, inputs: Mapping[str, Any]) -> None:
        for name, value in inputs.items():
            child = self[name]
            if isinstance(child, ComposeMetric):
                if not isinstance(value, Mapping):
                    raise TypeError(f"ComposeMetric.update: {name!r} is a nested compose; pass a mapping")
                child.update(value)
            elif isinstance(value, tuple):
                child.update(*value)
            else:
                child.update(value)

    def compute(self) -> dict[str, Any]:
        return {name: child.compute() for name, child in self._children.items()}

    def named_states(self) -> Iterator[tuple[str, MetricState]]:
        yield from super().named_states()
        for name, child in self._children.items():
            for sub, state in child.named_states():
                yield f"{name}.{sub}", state

    def to(self, device: torch.device | str) -> Self:
        super().to(device)
        for child in self._children.values():
            child.to(device)
        return self
