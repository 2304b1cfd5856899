"""Attention: masks, SDPA backends and grouped-query attention."""

from d9d.modules.attention.backends import (
    ATTENTION_BACKEND_ENV,
    AutoSdpa,
    EagerSdpa,
    FlashAttnSdpa,
    FlexSdpa,
    SdpaBackend,
    SdpaBackendName,
    SdpaCall,
    TorchSdpa,
    build_sdpa_backend,
)
from d9d.modules.attention.gqa import GroupedQueryAttention
from d9d.modules.attention.mask import (
    AttentionMask,
    PaddingSide,
    ShardedQueries,
    segment_ids_from_position_ids,
)

__all__ = [
    "ATTENTION_BACKEND_ENV",
    "AttentionMask",
    "AutoSdpa",
    "EagerSdpa",
    "FlashAttnSdpa",
    "FlexSdpa",
    "GroupedQueryAttention",
    "PaddingSide",
    "SdpaBackend",
    "SdpaBackendName",
    "SdpaCall",
    "ShardedQueries",
    "TorchSdpa",
    "build_sdpa_backend",
    "segment_ids_from_position_ids",
]
