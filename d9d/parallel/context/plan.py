"""Installing context-parallel attention on a model's attention layers."""

from __future__ import annotations

from torch import nn

from d9d.modules.attention import GroupedQueryAttention, SdpaBackend
from d9d.parallel.context.attention import ContextParallelSdpa
from d9d.parallel.context.layout import ContextParallelGroup


def parallelize_context_attention(
    module: nn.Module, cp: ContextParallelGroup, backend: SdpaBackend
) -> ContextParallelSdpa:
    """Every `GroupedQueryAttention` below `module` uses the returned backend, which wraps `backend` (the
    model's own, whose `prepare` the model calls once per forward: the caller puts the result there too).
    One wrapper for all layers, so the mask the model prepares is the one every layer reads."""
    wrapped = backend if isinstance(backend, ContextParallelSdpa) else ContextParallelSdpa(backend, cp)
    for sub in module.modules():
        if isinstance(sub, GroupedQueryAttention):
            sub.backend = wrapped
    return wrapped
