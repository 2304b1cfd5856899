"""Splitting a microbatch over the context-parallel ranks, before any model or task sees it.

Every per-token tensor is cut the same way (`ContextParallelGroup.shard`), so labels stay aligned with their
positions, each rank's loss and loss weight count its own tokens only, and the sums over dp × cp count every
token once. Positions become explicit first: a model that derives them from the local length would restart
them at 0 on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from d9d.parallel.context.layout import ContextParallelGroup, check_sequence_length

# The per-token keys of the causal-LM batches ([batch, seq]); everything else passes through unchanged.
SEQUENCE_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids", "attention_mask", "segment_ids")


def shard_microbatch(
    microbatch: Mapping[str, Any], cp: ContextParallelGroup, keys: tuple[str, ...] = SEQUENCE_KEYS
) -> dict[str, Any]:
    """This cp rank's share of `microbatch` (a mapping with `input_ids` [batch, seq])."""
    if "input_ids" not in microbatch:
        raise ValueError(
            "context parallelism splits microbatches by their input_ids, but this one has only "
            f"{sorted(microbatch)}"
        )
    ids: torch.Tensor = microbatch["input_ids"]
    batch, seq = ids.shape[:2]
    check_sequence_length(seq, cp.size)
    for name, value in microbatch.items():
        if (
            name not in keys
            and isinstance(value, torch.Tensor)
            and value.dim() >= 2
            and value.shape[1] == seq
        ):
            raise ValueError(
                f"microbatch key {name!r} has the sequence length in dim 1 but is not one of the per-token "
                f"keys {list(keys)} that context parallelism splits; rename it or pass it in `keys`"
            )
    out = dict(microbatch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq, device=ids.device).expand(batch, seq)
    index = cp.index(seq, ids.device)
    for name in keys:
        value = out.get(name)
        if isinstance(value, torch.Tensor):
            if value.shape[1] != seq:
                raise ValueError(
                    f"microbatch key {name!r} has shape {tuple(value.shape)}, not [batch, {seq}]"
                )
            out[name] = value.index_select(1, index)
    return out
