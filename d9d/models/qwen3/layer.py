"""One Qwen3 decoder layer: pre-norm attention and pre-norm SwiGLU, both residual."""

from __future__ import annotations

from d9d.models.decoder.layer import PreNormDecoderLayer
from d9d.models.qwen3.config import Qwen3Config
from d9d.modules.attention import GroupedQueryAttention, SdpaBackend
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe import MoELayer
from d9d.modules.norm import RMSNorm


def qwen3_attention(config: Qwen3Config, layer: int, backend: SdpaBackend) -> GroupedQueryAttention:
    return GroupedQueryAttention(
        config.hidden_size,
        config.num_attention_heads,
        config.num_kv_heads,
        config.head_dim,
        qk_norm=True,
        norm_eps=config.rms_norm_eps,
        bias=config.attention_bias,
        sliding_window=config.layer_window(layer),
        backend=backend,
        init_std=config.initializer_range,
        output_init_std=config.output_init_std,
        norm_backend=config.kernel_backend,
    )


def qwen3_mlp(config: Qwen3Config, intermediate_size: int) -> SwiGLU:
    return SwiGLU(
        config.hidden_size,
        intermediate_size,
        init_std=config.initializer_range,
        output_init_std=config.output_init_std,
        backend=config.kernel_backend,
    )


class Qwen3DecoderLayer(PreNormDecoderLayer):
    """`mlp` is injected: a dense SwiGLU in Qwen3, an `MoELayer` (or SwiGLU) in Qwen3-MoE.

    The attention output's residual add and the post-attention norm run as one fused add + norm
    (`RMSNorm.add_forward`); every norm (incl. the per-head q/k norms), SwiGLU gate and the rotary
    embedding use `config.kernel_backend`. Parameter names are those of Hugging Face's Qwen3.
    """

    def __init__(self, config: Qwen3Config, layer: int, backend: SdpaBackend, mlp: SwiGLU | MoELayer) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=config.kernel_backend)
        self.self_attn = qwen3_attention(config, layer, backend)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, backend=config.kernel_backend
        )
        self.mlp = mlp
        self.kernel_backend = config.kernel_backend
