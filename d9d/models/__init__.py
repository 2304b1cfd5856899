"""The model catalogue: Qwen3 and Qwen3-MoE built from d9d blocks, with Hugging Face interop."""

from d9d.models.hf import from_pretrained, save_pretrained
from d9d.models.qwen3 import (
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForEmbedding,
    Qwen3ForSequenceClassification,
    Qwen3Model,
    Qwen3StageModel,
)
from d9d.models.qwen3_moe import (
    Qwen3MoEConfig,
    Qwen3MoEForCausalLM,
    Qwen3MoEForEmbedding,
    Qwen3MoEForSequenceClassification,
    Qwen3MoEModel,
)

__all__ = [
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "Qwen3ForEmbedding",
    "Qwen3ForSequenceClassification",
    "Qwen3MoEConfig",
    "Qwen3MoEForCausalLM",
    "Qwen3MoEForEmbedding",
    "Qwen3MoEForSequenceClassification",
    "Qwen3MoEModel",
    "Qwen3Model",
    "Qwen3StageModel",
    "from_pretrained",
    "save_pretrained",
]
