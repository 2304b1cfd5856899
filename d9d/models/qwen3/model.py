"""The Qwen3 backbone for one pipeline stage: embeddings (first stage), its decoder layers, final norm
(last stage)."""

from __future__ import annotations

from d9d.models.decoder import DecoderBackbone
from d9d.models.qwen3.config import Qwen3Config
from d9d.models.qwen3.layer import Qwen3DecoderLayer, qwen3_mlp
from d9d.modules.attention import SdpaBackend
from d9d.modules.rotary import RotaryEmbedding
from d9d.pipeline.api import PipelineStageInfo


class Qwen3Model(DecoderBackbone):
    """Qwen3 decoder layers (`Qwen3DecoderLayer`, dense SwiGLU) over the shared stage plumbing of
    `DecoderBackbone` (embeddings, masks, activation checkpointing, final norm)."""

    config: Qwen3Config

    def __init__(self, config: Qwen3Config, stage: PipelineStageInfo | None = None) -> None:
        super().__init__(config, stage)

    def make_rotary(self) -> RotaryEmbedding:
        c = self.config
        return RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, c.rope_style)

    def layer_window(self, index: int) -> int | None:
        return self.config.layer_window(index)

    def make_layer(self, index: int, backend: SdpaBackend) -> Qwen3DecoderLayer:
        return Qwen3DecoderLayer(
            self.config, index, backend, qwen3_mlp(self.config, self.config.intermediate_size)
        )

    def decoder_layers(self) -> dict[int, Qwen3DecoderLayer]:  # type: ignore[override]
        """This stage's layers by global index."""
        return {int(name): layer for name, layer in self.layers.items()}  # type: ignore[misc]
