"""Task heads: causal LM (chunked loss), sequence classification, embeddings."""

from d9d.modules.heads.causal_lm import CausalLMHead
from d9d.modules.heads.classification import SequenceClassificationHead
from d9d.modules.heads.embedding import EmbeddingHead
from d9d.modules.heads.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy
from d9d.modules.heads.pooling import Pooling, pool

__all__ = [
    "IGNORE_INDEX",
    "CausalLMHead",
    "EmbeddingHead",
    "Pooling",
    "SequenceClassificationHead",
    "linear_cross_entropy",
    "pool",
]
