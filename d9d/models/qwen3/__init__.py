"""Qwen3 dense: config, decoder layer, stage backbone and task models."""

from d9d.models.qwen3.config import Qwen3Config
from d9d.models.qwen3.layer import Qwen3DecoderLayer
from d9d.models.qwen3.model import Qwen3Model
from d9d.models.qwen3.tasks import (
    Qwen3ForCausalLM,
    Qwen3ForEmbedding,
    Qwen3ForSequenceClassification,
    Qwen3StageModel,
)

__all__ = [
    "Qwen3Config",
    "Qwen3DecoderLayer",
    "Qwen3ForCausalLM",
    "Qwen3ForEmbedding",
    "Qwen3ForSequenceClassification",
    "Qwen3Model",
    "Qwen3StageModel",
]
