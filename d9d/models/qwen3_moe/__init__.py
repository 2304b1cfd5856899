"""Qwen3-MoE: config, backbone and task models."""

from d9d.models.qwen3_moe.config import Qwen3MoEConfig
from d9d.models.qwen3_moe.model import Qwen3MoEModel
from d9d.models.qwen3_moe.tasks import (
    Qwen3MoEForCausalLM,
    Qwen3MoEForEmbedding,
    Qwen3MoEForSequenceClassification,
)

__all__ = [
    "Qwen3MoEConfig",
    "Qwen3MoEForCausalLM",
    "Qwen3MoEForEmbedding",
    "Qwen3MoEForSequenceClassification",
    "Qwen3MoEModel",
]
