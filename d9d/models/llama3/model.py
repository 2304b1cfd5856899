"""The Llama 3 backbone for one pipeline stage: embeddings (first stage), its decoder layers, final norm
(last stage)."""

from __future__ import annotations

from torch import nn

from d9d.models.decoder import DecoderBackbone
from d9d.models.llama3.config import Llama3Config
from d9d.models.llama3.layer import Llama3DecoderLayer
from d9d.models.llama3.rope import Llama3RopeScaling, Llama3RotaryEmbedding
from d9d.modules.attention import SdpaBackend
from d9d.modules.rotary import RotaryEmbedding
from d9d.pipeline.api import PipelineStageInfo


class Llama3Model(DecoderBackbone):
    """`Llama3DecoderLayer`s over the shared stage plumbing of `DecoderBackbone`."""

    config: Llama3Config

    def __init__(self, config: Llama3Config, stage: PipelineStageInfo | None = None) -> None:
        super().__init__(config, stage)

    def make_rotary(self) -> nn.Module:
        c = self.config
        if isinstance(c.rope_scaling, Llama3RopeScaling):
            return Llama3RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
        return RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, "half")

    def make_layer(self, index: int, backend: SdpaBackend) -> Llama3DecoderLayer:
        return Llama3DecoderLayer(self.config, backend)
