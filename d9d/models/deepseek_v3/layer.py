"""One DeepSeek-V3 decoder layer: pre-norm multi-head latent attention and a pre-norm dense SwiGLU (the first
layers) or MoE layer (routed + shared experts), both residual."""

from __future__ import annotations

from d9d.models.decoder.layer import PreNormDecoderLayer
from d9d.models.deepseek_v3.attention import MultiHeadLatentAttention
from d9d.models.deepseek_v3.config import DeepSeekV3Config
from d9d.modules.attention import SdpaBackend
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe import GroupedExperts, LocalMoECommunication, MoELayer, TopKRouter, build_grouped_mm
from d9d.modules.norm import RMSNorm


def deepseek_attention(config: DeepSeekV3Config, backend: SdpaBackend) -> MultiHeadLatentAttention:
    return MultiHeadLatentAttention(
        config.hidden_size,
        config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        scale=config.softmax_scale,
        bias=config.attention_bias,
        norm_eps=1e-6,  # Hugging Face's latent norms keep their default epsilon, whatever rms_norm_eps is
        backend=backend,
        init_std=config.initializer_range,
        output_init_std=config.output_init_std,
        norm_backend=config.kernel_backend,
    )


def deepseek_mlp(config: DeepSeekV3Config, layer: int) -> SwiGLU | MoELayer:
    swiglu = {
        "init_std": config.initializer_range,
        "output_init_std": config.output_init_std,
        "backend": config.kernel_backend,
    }
    if not config.is_moe_layer(layer):
        return SwiGLU(config.hidden_size, config.intermediate_size, **swiglu)  # type: ignore[arg-type]
    shared = (
        SwiGLU(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts, **swiglu)  # type: ignore[arg-type]
        if config.num_shared_experts
        else None
    )
    return MoELayer(
        TopKRouter(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalize=config.norm_topk_prob,
            score_function="sigmoid",
            expert_bias=config.expert_bias,
            bias_update_rate=config.expert_bias_update_rate,
            init_std=config.initializer_range,
            num_groups=config.num_expert_groups,
            topk_groups=config.topk_groups,
            scaling_factor=config.routed_scaling_factor,
        ),
        GroupedExperts(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            grouped_mm=build_grouped_mm(config.grouped_mm),
            init_std=config.initializer_range,
            output_init_std=config.output_init_std,
        ),
        communication=LocalMoECommunication(align=config.moe_row_align, backend=config.moe_kernels),
        shared_expert=shared,
        aux_loss_coef=config.router_aux_loss_coef,
        init_std=config.initializer_range,
    )


class DeepSeekV3DecoderLayer(PreNormDecoderLayer):
    """`x + attn(norm(x))`, then `x + mlp(norm(x))` (the attention's residual add and the second norm fused).
    Parameter names are Hugging Face's, except the MoE layer's shared expert (`mlp.shared_expert`, HF
    `mlp.shared_experts`) and expert bias (`mlp.gate.expert_bias`, HF `e_score_correction_bias`)."""

    def __init__(self, config: DeepSeekV3Config, layer: int, backend: SdpaBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend=config.kernel_backend)
        self.self_attn = deepseek_attention(config, backend)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, backend=config.kernel_backend
        )
        self.mlp = deepseek_mlp(config, layer)
        self.kernel_backend = config.kernel_backend
