"""Qwen3-MoE task models: the Qwen3 task heads over the MoE backbone."""

from __future__ import annotations

from typing import ClassVar

from d9d.models.decoder import DecoderBackbone
from d9d.models.qwen3.tasks import Qwen3ForCausalLM, Qwen3ForEmbedding, Qwen3ForSequenceClassification
from d9d.models.qwen3_moe.model import Qwen3MoEModel


class Qwen3MoEForCausalLM(Qwen3ForCausalLM):
    backbone_class: ClassVar[type[DecoderBackbone]] = Qwen3MoEModel


class Qwen3MoEForSequenceClassification(Qwen3ForSequenceClassification):
    backbone_class: ClassVar[type[DecoderBackbone]] = Qwen3MoEModel


class Qwen3MoEForEmbedding(Qwen3ForEmbedding):
    backbone_class: ClassVar[type[DecoderBackbone]] = Qwen3MoEModel
