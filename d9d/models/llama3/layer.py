"""One Llama 3 decoder layer: pre-norm grouped-query attention and pre-norm SwiGLU, both residual."""

from __future__ import annotations

from d9d.models.decoder.layer import PreNormDecoderLayer
from d9d.models.llama3.config import Llama3Config
from d9d.modules.attention import GroupedQueryAttention, SdpaBackend
from d9d.modules.mlp import SwiGLU
from d9d.modules.norm import RMSNorm


class Llama3DecoderLayer(PreNormDecoderLayer):
    """`x + attn(norm(x))`, then `x + mlp(norm(x))`; the attention output's residual add and the
    post-attention norm run as one fused add + norm. Parameter names are those of Hugging Face's Llama."""

    def __init__(self, config: Llama3Config, backend: SdpaBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=config.kernel_backend)
        self.self_attn = GroupedQueryAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_kv_heads,
            config.head_dim,
            qk_norm=False,
            bias=config.attention_bias,
            backend=backend,
            init_std=config.initializer_range,
            output_init_std=config.output_init_std,
        )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, backend=config.kernel_backend
        )
        self.mlp = SwiGLU(
            config.hidden_size,
            config.intermediate_size,
            init_std=config.initializer_range,
            output_init_std=config.output_init_std,
            backend=config.kernel_backend,
        )
        self.kernel_backend = config.kernel_backend
