"""Context-parallel attention as an `SdpaBackend` around any exact kernel.

Strategy `allgather`: each layer all-gathers keys and values over the cp ranks (`gather_sequence`, whose
backward reduce-scatters their gradients) and runs the wrapped kernel for its own queries against the whole
sequence, with a mask that maps local queries to their global positions (`ShardedQueries`). The mask is
prepared once per forward: the whole-sequence segment ids and padding are gathered once, not per layer.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import torch

from d9d.modules.attention import AttentionMask, SdpaBackend, SdpaCall, ShardedQueries
from d9d.parallel.context.comm import gather_sequence
from d9d.parallel.context.layout import ContextParallelGroup


class ContextParallelSdpa:
    """Wraps `inner` (torch / eager / flex / auto) so that the sequence may be split over `cp`.

    `inner` must take arbitrary masks: `flash_attn` (plain causal only) cannot, since local queries are not
    in key order; the job config rejects that pairing before anything starts.
    """

    def __init__(self, inner: SdpaBackend, cp: ContextParallelGroup) -> None:
        self.inner = inner
        self.cp = cp

    def prepare(
        self, mask: AttentionMask, *, seq_len: int, windows: Collection[int | None], device: torch.device
    ) -> AttentionMask:
        key_len = seq_len * self.cp.size
        sharded = ShardedQueries(
            query_index=self.cp.index(key_len, device),
            key_len=key_len,
            segment_ids=self.cp.gather(mask.segment_ids) if mask.segment_ids is not None else None,
            padding=self.cp.gather(mask.padding) if mask.padding is not None else None,
        )
        return self.inner.prepare(
            replace(mask, sharded=sharded), seq_len=seq_len, windows=windows, device=device
        )

    def __call__(self, call: SdpaCall) -> torch.Tensor:
        if call.mask.sharded is None:
            raise RuntimeError(
                "context-parallel attention got a mask its prepare() did not build: the model must call the "
                "backend's prepare once per forward"
            )
        k = gather_sequence(call.k, self.cp, dim=2)
        v = gather_sequence(call.v, self.cp, dim=2)
        return self.inner(replace(call, k=k, v=v))
