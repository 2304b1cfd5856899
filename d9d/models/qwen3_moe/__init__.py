"""Qwen3-MoE: config, backbone, task models, Hugging Face format and the family spec it registers
(`QWEN3_MOE`); layers and the parallel plan are Qwen3's."""

from d9d.models.family import register_family
from d9d.models.qwen3.family import parallelize_qwen3 as parallelize_qwen3_moe
from d9d.models.qwen3_moe.config import Qwen3MoEConfig
from d9d.models.qwen3_moe.family import QWEN3_MOE
from d9d.models.qwen3_moe.model import Qwen3MoEModel
from d9d.models.qwen3_moe.tasks import (
    Qwen3MoEForCausalLM,
    Qwen3MoEForEmbedding,
    Qwen3MoEForSequenceClassification,
)

FAMILY = register_family(QWEN3_MOE)

__all__ = [
    "FAMILY",
    "QWEN3_MOE",
    "Qwen3MoEConfig",
    "Qwen3MoEForCausalLM",
    "Qwen3MoEForEmbedding",
    "Qwen3MoEForSequenceClassification",
    "Qwen3MoEModel",
    "parallelize_qwen3_moe",
]
