"""Datasets: random-access sources, length bucketing, DP sharding with a resumable cursor, collation.

A typical per-rank pipeline, outermost last:

    documents → TokenizedDataset → BufferSortedDataset → ShardedDataset → CausalLMCollator

Everything below `ShardedDataset` is a pure function of its configuration, seed and epoch, identical on
every rank; `ShardedDataset` deals that global order to DP ranks and holds the only cursor.
"""

from d9d.data.bucketing import BufferSortedDataset, token_count
from d9d.data.collate import (
    IGNORE_INDEX,
    CausalLMCollator,
    block_causal_mask,
    pack_sequences,
    pad_stack,
    plan_packs,
    pooling_weights,
)
from d9d.data.protocols import EpochAware, SizedDataset, Stateful
from d9d.data.sharding import ShardedDataset
from d9d.data.sources import (
    DatasetConfig,
    FileDocuments,
    HFDatasetConfig,
    HFDocuments,
    TextDatasetConfig,
    TokenizedDataset,
    build_dataset,
    build_text_dataset,
    check_dataset,
)
from d9d.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerConfig, build_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "BufferSortedDataset",
    "ByteTokenizer",
    "CausalLMCollator",
    "DatasetConfig",
    "EpochAware",
    "FileDocuments",
    "HFDatasetConfig",
    "HFDocuments",
    "HFTokenizer",
    "ShardedDataset",
    "SizedDataset",
    "Stateful",
    "TextDatasetConfig",
    "TokenizedDataset",
    "Tokenizer",
    "TokenizerConfig",
    "block_causal_mask",
    "build_dataset",
    "build_text_dataset",
    "build_tokenizer",
    "check_dataset",
    "pack_sequences",
    "pad_stack",
    "plan_packs",
    "pooling_weights",
    "token_count",
]
