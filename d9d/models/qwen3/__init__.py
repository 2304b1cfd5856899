"""Qwen3 dense: config, decoder layer, stage backbone, task models, Hugging Face format, parallel plan, and
the family spec it registers (`QWEN3`)."""

from d9d.models.family import register_family
from d9d.models.qwen3.config import Qwen3Config
from d9d.models.qwen3.family import QWEN3, parallelize_qwen3
from d9d.models.qwen3.layer import Qwen3DecoderLayer
from d9d.models.qwen3.model import Qwen3Model
from d9d.models.qwen3.tasks import (
    Qwen3ForCausalLM,
    Qwen3ForEmbedding,
    Qwen3ForSequenceClassification,
)

FAMILY = register_family(QWEN3)

__all__ = [
    "FAMILY",
    "QWEN3",
    "Qwen3Config",
    "Qwen3DecoderLayer",
    "Qwen3ForCausalLM",
    "Qwen3ForEmbedding",
    "Qwen3ForSequenceClassification",
    "Qwen3Model",
    "parallelize_qwen3",
]
