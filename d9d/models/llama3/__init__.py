"""Llama 3 dense (3.0 – 3.3): config, decoder layer, stage backbone, task models, Hugging Face format
(`LlamaForCausalLM`), parallel plan, and the family spec it registers (`LLAMA3`)."""

from d9d.models.family import register_family
from d9d.models.llama3.config import Llama3Config
from d9d.models.llama3.family import LLAMA3, parallelize_llama3
from d9d.models.llama3.layer import Llama3DecoderLayer
from d9d.models.llama3.model import Llama3Model
from d9d.models.llama3.rope import Llama3RopeScaling, Llama3RotaryEmbedding, llama3_inv_freq
from d9d.models.llama3.tasks import Llama3ForCausalLM, Llama3ForEmbedding, Llama3ForSequenceClassification

FAMILY = register_family(LLAMA3)

__all__ = [
    "FAMILY",
    "LLAMA3",
    "Llama3Config",
    "Llama3DecoderLayer",
    "Llama3ForCausalLM",
    "Llama3ForEmbedding",
    "Llama3ForSequenceClassification",
    "Llama3Model",
    "Llama3RopeScaling",
    "Llama3RotaryEmbedding",
    "llama3_inv_freq",
    "parallelize_llama3",
]
