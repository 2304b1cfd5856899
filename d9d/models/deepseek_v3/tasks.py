"""DeepSeek-V3 with task heads (`d9d.models.decoder`'s heads over the DeepSeek-V3 backbone)."""

from __future__ import annotations

from typing import ClassVar

from d9d.models.decoder import (
    DecoderBackbone,
    DecoderForCausalLM,
    DecoderForEmbedding,
    DecoderForSequenceClassification,
)
from d9d.models.deepseek_v3.config import DeepSeekV3Config
from d9d.models.deepseek_v3.model import DeepSeekV3Model


class DeepSeekV3ForCausalLM(DecoderForCausalLM):
    backbone_class: ClassVar[type[DecoderBackbone]] = DeepSeekV3Model
    config: DeepSeekV3Config
    model: DeepSeekV3Model


class DeepSeekV3ForSequenceClassification(DecoderForSequenceClassification):
    backbone_class: ClassVar[type[DecoderBackbone]] = DeepSeekV3Model
    config: DeepSeekV3Config
    model: DeepSeekV3Model


class DeepSeekV3ForEmbedding(DecoderForEmbedding):
    backbone_class: ClassVar[type[DecoderBackbone]] = DeepSeekV3Model
    config: DeepSeekV3Config
    model: DeepSeekV3Model
