"""Tensor parallelism: column/row-split blocks, vocabulary-parallel embedding and head, sequence parallel."""

from d9d.parallel.tensor.blocks import (
    RowParallelLinear,
    enter_tp_region,
    parallelize_attention_tp,
    parallelize_moe_tp,
    parallelize_norm_tp,
    parallelize_swiglu_tp,
    shard_columns,
    shard_rows,
)
from d9d.parallel.tensor.comm import (
    copy_to_group,
    gather_from_group,
    gather_sum_grad,
    reduce_from_group,
    scatter_sum,
    split_to_group,
)
from d9d.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from d9d.parallel.tensor.vocab import (
    VocabParallelCausalLMHead,
    VocabParallelTokenEmbedding,
    parallelize_vocab_embedding,
    parallelize_vocab_head,
)

__all__ = [
    "RowParallelLinear",
    "VocabParallelCausalLMHead",
    "VocabParallelTokenEmbedding",
    "copy_to_group",
    "enter_tp_region",
    "gather_from_group",
    "gather_sum_grad",
    "parallelize_attention_tp",
    "parallelize_moe_tp",
    "parallelize_norm_tp",
    "parallelize_swiglu_tp",
    "parallelize_vocab_embedding",
    "parallelize_vocab_head",
    "reduce_from_group",
    "scatter_sum",
    "shard_columns",
    "shard_rows",
    "split_to_group",
    "vocab_parallel_cross_entropy",
]
