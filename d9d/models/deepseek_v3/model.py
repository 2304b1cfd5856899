"""The DeepSeek-V3 backbone for one pipeline stage."""

from __future__ import annotations

from d9d.models.decoder import DecoderBackbone
from d9d.models.deepseek_v3.config import DeepSeekV3Config
from d9d.models.deepseek_v3.layer import DeepSeekV3DecoderLayer
from d9d.modules.attention import SdpaBackend
from d9d.modules.rotary import RotaryEmbedding, RotaryStyle
from d9d.pipeline.api import PipelineStageInfo


class DeepSeekV3Model(DecoderBackbone):
    """`DeepSeekV3DecoderLayer`s over `DecoderBackbone`; the rotary tables cover `qk_rope_head_dim` dims."""

    config: DeepSeekV3Config

    def __init__(self, config: DeepSeekV3Config, stage: PipelineStageInfo | None = None) -> None:
        super().__init__(config, stage)

    def make_rotary(self) -> RotaryEmbedding:
        c = self.config
        style: RotaryStyle = "interleaved" if c.rope_interleave else "half"
        return RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, style)

    def make_layer(self, index: int, backend: SdpaBackend) -> DeepSeekV3DecoderLayer:
        return DeepSeekV3DecoderLayer(self.config, index, backend)
