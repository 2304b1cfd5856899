"""The Qwen3-MoE backbone: Qwen3's stage backbone with sparse feed-forward layers."""

from __future__ import annotations

from d9d.models.qwen3.layer import Qwen3DecoderLayer, qwen3_mlp
from d9d.models.qwen3.model import Qwen3Model
from d9d.models.qwen3_moe.config import Qwen3MoEConfig
from d9d.modules.attention import SdpaBackend
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe import GroupedExperts, LocalMoECommunication, MoELayer, TopKRouter, build_grouped_mm
from d9d.pipeline.api import PipelineStageInfo


class Qwen3MoEModel(Qwen3Model):
    def __init__(self, config: Qwen3MoEConfig, stage: PipelineStageInfo | None = None) -> None:
        if not isinstance(config, Qwen3MoEConfig):
            raise TypeError(f"Qwen3MoEModel needs a Qwen3MoEConfig, got {type(config).__name__}")
        self.moe_config = config
        super().__init__(config, stage)

    def make_layer(self, index: int, backend: SdpaBackend) -> Qwen3DecoderLayer:
        config = self.moe_config
        mlp: MoELayer | SwiGLU
        if config.is_moe_layer(index):
            mlp = MoELayer(
                TopKRouter(
                    config.hidden_size,
                    config.num_experts,
                    config.num_experts_per_tok,
                    renormalize=config.norm_topk_prob,
                    score_function=config.router_score_function,
                    expert_bias=config.expert_bias,
                    bias_update_rate=config.expert_bias_update_rate,
                    init_std=config.initializer_range,
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
                aux_loss_coef=config.router_aux_loss_coef,
                init_std=config.initializer_range,
            )
        else:
            mlp = qwen3_mlp(config, config.intermediate_size)
        return Qwen3DecoderLayer(config, index, backend, mlp)
