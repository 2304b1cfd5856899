"""The Qwen3-MoE family spec: Qwen3's with sparse feed-forward layers (see `d9d.models.family`)."""

from __future__ import annotations

from torch import nn

from d9d.models.decoder import decoder_footprint, decoder_stage_costs
from d9d.models.family import MeshSplit, ModelFamily, StageFootprint
from d9d.models.qwen3.family import (
    attention_op_values,
    attention_splits,
    family_parallelize,
    layer_costs,
    swiglu_op_values,
)
from d9d.models.qwen3_moe.config import Qwen3MoEConfig
from d9d.models.qwen3_moe.hf import QWEN3_MOE_HF
from d9d.models.qwen3_moe.tasks import Qwen3MoEForCausalLM
from d9d.modules.moe import MoELayer
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.partition import StageCosts


def stage_costs(config: Qwen3MoEConfig, seq_len: int) -> StageCosts:
    """MoE layers count the routed experts (top-k) and the router only."""
    h = config.hidden_size
    ffn = [
        3 * h * config.moe_intermediate_size * config.num_experts_per_tok + h * config.num_experts
        if config.is_moe_layer(i)
        else 3 * h * config.intermediate_size
        for i in range(config.num_layers)
    ]
    return decoder_stage_costs(config.vocab_size, h, layer_costs(config, ffn), seq_len)


def flops_per_token(config: Qwen3MoEConfig, seq_len: int) -> float:
    return stage_costs(config, seq_len).total


def footprint(config: Qwen3MoEConfig, module: nn.Module) -> StageFootprint | None:
    """Per layer and token `8 × hidden + 3 × ffn` values, `ffn` being `num_experts_per_tok ×
    moe_intermediate_size` in MoE layers and `intermediate_size` in dense ones; under op-level selective
    checkpointing the projections', the experts', the router's and the attention's outputs."""

    def moe(layer: nn.Module) -> bool:
        return isinstance(getattr(layer, "mlp", None), MoELayer)

    def values(_index: int, layer: nn.Module) -> int:
        if moe(layer):
            ffn = config.num_experts_per_tok * config.moe_intermediate_size
        else:
            ffn = config.intermediate_size
        return 8 * config.hidden_size + 3 * ffn

    def ops(_index: int, layer: nn.Module) -> int:
        h = config.hidden_size
        if moe(layer):
            k = config.num_experts_per_tok
            mlp = swiglu_op_values(h, k * config.moe_intermediate_size, k) + config.num_experts
        else:
            mlp = swiglu_op_values(h, config.intermediate_size)
        return attention_op_values(config) + mlp

    return decoder_footprint(
        module, values, loss_chunk_size=config.loss_chunk_size, vocab_size=config.vocab_size, op_values=ops
    )


def mesh_splits(config: Qwen3MoEConfig) -> list[MeshSplit]:
    # an MoE model's dense MLPs may be none at all: intermediate_size is not checked
    return [*attention_splits(config), MeshSplit("num_experts", config.num_experts, "expert_parallel")]


def build_causal_lm(config: Qwen3MoEConfig, stage: PipelineStageInfo | None) -> nn.Module:
    return Qwen3MoEForCausalLM(config, stage)


QWEN3_MOE = ModelFamily(
    name="qwen3_moe",
    config_class=Qwen3MoEConfig,
    build_causal_lm=build_causal_lm,
    parallelize=family_parallelize,
    flops_per_token=flops_per_token,
    stage_costs=stage_costs,
    footprint=footprint,
    mesh_splits=mesh_splits,
    hf=QWEN3_MOE_HF,
    description="Qwen3-MoE: Qwen3 attention with top-k routed SwiGLU experts (softmax or sigmoid routing)",
)
