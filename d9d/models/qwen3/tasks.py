"""Qwen3 with task heads: causal LM, sequence classification, embeddings (`d9d.models.decoder`'s heads over
the Qwen3 backbone). Each is pipeline-stage aware."""

from __future__ import annotations

from typing import ClassVar

from d9d.models.decoder import (
    DecoderBackbone,
    DecoderForCausalLM,
    DecoderForEmbedding,
    DecoderForSequenceClassification,
)
from d9d.models.qwen3.config import Qwen3Config
from d9d.models.qwen3.model import Qwen3Model


class Qwen3ForCausalLM(DecoderForCausalLM):
    backbone_class: ClassVar[type[DecoderBackbone]] = Qwen3Model
    config: Qwen3Config
    model: Qwen3Model


class Qwen3ForSequenceClassification(DecoderForSequenceClassification):
    backbone_class: ClassVar[type[DecoderBackbone]] = Qwen3Model
    config: Qwen3Config
    model: Qwen3Model


class Qwen3ForEmbedding(DecoderForEmbedding):
    backbone_class: ClassVar[type[DecoderBackbone]] = Qwen3Model
    config: Qwen3Config
    model: Qwen3Model
