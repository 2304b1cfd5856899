"""Context parallelism: one sequence split over the `cp` ranks, attention over the whole of it.

- `layout`: the load-balanced causal chunking (rank i holds chunks i and 2·cp − 1 − i).
- `batch`: splits a microbatch's per-token tensors before the model sees them (positions made explicit).
- `attention`: `ContextParallelSdpa`, the attention backend that gathers keys/values over cp.
- `plan`: installs that backend on a model's attention layers.
"""

from d9d.parallel.context.attention import ContextParallelSdpa
from d9d.parallel.context.batch import SEQUENCE_KEYS, shard_microbatch
from d9d.parallel.context.comm import gather_sequence
from d9d.parallel.context.config import ContextAttention
from d9d.parallel.context.layout import (
    ContextParallelGroup,
    check_sequence_length,
    gathered_order,
    load_balanced_index,
)
from d9d.parallel.context.plan import parallelize_context_attention

__all__ = [
    "SEQUENCE_KEYS",
    "ContextAttention",
    "ContextParallelGroup",
    "ContextParallelSdpa",
    "check_sequence_length",
    "gather_sequence",
    "gathered_order",
    "load_balanced_index",
    "parallelize_context_attention",
    "shard_microbatch",
]
