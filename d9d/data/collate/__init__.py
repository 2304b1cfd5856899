"""Turning samples into batches: padding, packing, pooling masks and the causal-LM collator."""

from d9d.data.collate.causal_lm import IGNORE_INDEX, CausalLMCollator, next_token_labels
from d9d.data.collate.packing import block_causal_mask, pack_sequences, plan_packs
from d9d.data.collate.padding import PadSide, pad_stack, round_up
from d9d.data.collate.pooling import PoolingKind, pooling_weights

__all__ = [
    "IGNORE_INDEX",
    "CausalLMCollator",
    "PadSide",
    "PoolingKind",
    "block_causal_mask",
    "next_token_labels",
    "pack_sequences",
    "pad_stack",
    "plan_packs",
    "pooling_weights",
    "round_up",
]
