"""The model catalogue: families of decoder LMs built from d9d blocks, each in its own folder with its Hugging
Face format, parallel plan and cost model (`d9d.models.family`), registered by `d9d.models.catalogue`."""

from d9d.models.catalogue import BUILTIN_FAMILIES
from d9d.models.family import (
    ModelFamily,
    families,
    family_for_model_type,
    family_of,
    get_family,
    register_family,
)
from d9d.models.hf import from_pretrained, save_pretrained
from d9d.models.qwen3 import (
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForEmbedding,
    Qwen3ForSequenceClassification,
    Qwen3Model,
)
from d9d.models.qwen3_moe import (
    Qwen3MoEConfig,
    Qwen3MoEForCausalLM,
    Qwen3MoEForEmbedding,
    Qwen3MoEForSequenceClassification,
    Qwen3MoEModel,
)

__all__ = [
    "BUILTIN_FAMILIES",
    "ModelFamily",
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
    "families",
    "family_for_model_type",
    "family_of",
    "from_pretrained",
    "get_family",
    "register_family",
    "save_pretrained",
]
