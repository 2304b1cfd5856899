"""Llama 3 with task heads: causal LM, sequence classification, embeddings (`d9d.models.decoder`'s heads)."""

from __future__ import annotations

from typing import ClassVar

from d9d.models.decoder import (
    DecoderBackbone,
    DecoderForCausalLM,
    DecoderForEmbedding,
    DecoderForSequenceClassification,
)
from d9d.models.llama3.config import Llama3Config
from d9d.models.llama3.model import Llama3Model


class Llama3ForCausalLM(DecoderForCausalLM):
    backbone_class: ClassVar[type[DecoderBackbone]] = Llama3Model
    config: Llama3Config
    model: Llama3Model


class Llama3ForSequenceClassification(DecoderForSequenceClassification):
    backbone_class: ClassVar[type[DecoderBackbone]] = Llama3Model
    config: Llama3Config
    model: Llama3Model


class Llama3ForEmbedding(DecoderForEmbedding):
    backbone_class: ClassVar[type[DecoderBackbone]] = Llama3Model
    config: Llama3Config
    model: Llama3Model
