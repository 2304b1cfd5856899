"""DeepSeek-V3-style MoE: config, multi-head latent attention, decoder layer (dense or routed + shared
experts), stage backbone, task models, Hugging Face format (`DeepseekV3ForCausalLM`), parallel plan, and the
family spec it registers (`DEEPSEEK_V3`)."""

from d9d.models.deepseek_v3.attention import MultiHeadLatentAttention, SharedRopeKey
from d9d.models.deepseek_v3.config import DeepSeekV3Config
from d9d.models.deepseek_v3.family import (
    DEEPSEEK_V3,
    parallelize_deepseek_v3,
    parallelize_latent_attention_tp,
)
from d9d.models.deepseek_v3.layer import DeepSeekV3DecoderLayer
from d9d.models.deepseek_v3.model import DeepSeekV3Model
from d9d.models.deepseek_v3.tasks import (
    DeepSeekV3ForCausalLM,
    DeepSeekV3ForEmbedding,
    DeepSeekV3ForSequenceClassification,
)
from d9d.models.family import register_family

FAMILY = register_family(DEEPSEEK_V3)

__all__ = [
    "DEEPSEEK_V3",
    "FAMILY",
    "DeepSeekV3Config",
    "DeepSeekV3DecoderLayer",
    "DeepSeekV3ForCausalLM",
    "DeepSeekV3ForEmbedding",
    "DeepSeekV3ForSequenceClassification",
    "DeepSeekV3Model",
    "MultiHeadLatentAttention",
    "SharedRopeKey",
    "parallelize_deepseek_v3",
    "parallelize_latent_attention_tp",
]
