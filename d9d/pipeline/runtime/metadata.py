"""What each stage sends downstream, known to the receiving rank before any microbatch runs.

Receive buffers are allocated from the sending stage's `stage_output_meta`, which only the sending rank can
evaluate. Ranks exchange their stages' metadata once per distinct shape of the microbatch inputs: every rank
of a pipeline group sees the same microbatches, so all of them hit or miss the cache together and the exchange
(a collective on the pipeline group) never deadlocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from d9d.core.dist_ops import all_gather_object
from d9d.pipeline.api import TensorMeta
from d9d.pipeline.runtime.stage import StageRuntime

StageMetas = dict[int, list[dict[str, TensorMeta]]]
"""Stage -> per microbatch -> output name -> meta."""

_Signature = tuple[tuple[tuple[str, object], ...], ...]


class MetadataExchange:
    def __init__(self, stages: Sequence[StageRuntime], group: dist.ProcessGroup | None) -> None:
        self._stages = stages
        self._group = group
        self._cache: dict[_Signature, StageMetas] = {}

    def metas(self, microbatches: Sequence[Mapping[str, torch.Tensor]]) -> StageMetas:
        signature = tuple(tuple(sorted((n, _key(n, v)) for n, v in mb.items())) for mb in microbatches)
        cached = self._cache.get(signature)
        if cached is not None:
            return cached
        local: StageMetas = {s.index: [s.output_meta(mb) for mb in microbatches] for s in self._stages}
        merged: StageMetas = {}
        parts = all_gather_object(local, group=self._group) if self._group is not None else [local]
        for part in parts:
            merged.update(part)
        self._cache[signature] = merged
        return merged


def _key(name: str, value: object) -> object:
    """What of a microbatch input decides the output metadata: a tensor's shape and dtype, or a constant
    itself (a collator's `padding_side="right"`, a flag), which must then be hashable."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if value is None or isinstance(value, str | int | float | bool):
        return (type(value).__name__, value)
    raise TypeError(
        f"pipeline microbatch input {name!r} is a {type(value).__name__}: stages take tensors and plain "
        "constants (str, int, float, bool, None)"
    )
