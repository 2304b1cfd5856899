"""The Qwen3 family spec: what the engine needs from Qwen3 (see `d9d.models.family`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from d9d.core import DistributedContext
from d9d.models.decoder import (
    DecoderStageModel,
    LayerCost,
    decoder_footprint,
    decoder_stage_costs,
    parallelize_decoder,
)
from d9d.models.family import MeshSplit, ModelFamily, StageFootprint
from d9d.models.qwen3.config import Qwen3Config
from d9d.models.qwen3.hf import QWEN3_HF
from d9d.models.qwen3.tasks import Qwen3ForCausalLM
from d9d.parallel.plans import ParallelPlanConfig
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.partition import StageCosts


def parallelize_qwen3(
    model: DecoderStageModel,
    ctx: DistributedContext,
    config: ParallelPlanConfig | None = None,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    activation_dtype: torch.dtype | None = None,
) -> None:
    """Expert, tensor, context and data parallelism for one pipeline stage of a Qwen3 / Qwen3-MoE task model
    (`parallelize_decoder` with the pre-norm layer's tensor-parallel plan)."""
    parallelize_decoder(model, ctx, config, mp_policy=mp_policy, activation_dtype=activation_dtype)


def family_parallelize(
    module: nn.Module, ctx: DistributedContext, plan: ParallelPlanConfig, activation_dtype: torch.dtype | None
) -> None:
    if not isinstance(module, DecoderStageModel):
        raise TypeError(f"the Qwen3 plan parallelizes decoder task models, not {type(module).__name__}")
    parallelize_qwen3(module, ctx, plan, activation_dtype=activation_dtype)


def attention_params(config: Qwen3Config) -> int:
    h, q, kv = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
    )
    return h * (q + 2 * kv) + q * h


def layer_costs(config: Qwen3Config, ffn_params: list[int]) -> list[LayerCost]:
    """Per layer: the attention projections plus `ffn_params[i]`; scores over `heads × head_dim`."""
    q = config.num_attention_heads * config.head_dim
    return [
        LayerCost(attention_params(config) + ffn, q, q, config.layer_window(i))
        for i, ffn in enumerate(ffn_params)
    ]


def stage_costs(config: Qwen3Config, seq_len: int) -> StageCosts:
    ffn = [3 * config.hidden_size * config.intermediate_size] * config.num_layers
    return decoder_stage_costs(config.vocab_size, config.hidden_size, layer_costs(config, ffn), seq_len)


def flops_per_token(config: Qwen3Config, seq_len: int) -> float:
    return stage_costs(config, seq_len).total


def attention_op_values(config: Qwen3Config) -> int:
    """Per token, the attention's matmul and kernel outputs that op-level selective checkpointing keeps: the
    q, k, v projections, the attention output and o_proj."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return (q + 2 * kv) + q + config.hidden_size


def swiglu_op_values(hidden_size: int, width: int, copies: int = 1) -> int:
    """Per token, the gate, up and down projection outputs of `copies` SwiGLUs of `width` (the top-k experts a
    token is routed to are `copies`, with `width` their sum)."""
    return 2 * width + copies * hidden_size


def footprint(config: Qwen3Config, module: nn.Module) -> StageFootprint | None:
    """Per decoder layer and token about `8 × hidden + 3 × intermediate` values kept for backward (norm,
    attention and MLP inputs and outputs); under op-level selective checkpointing the projections' and the
    attention's outputs."""
    values = 8 * config.hidden_size + 3 * config.intermediate_size
    ops = attention_op_values(config) + swiglu_op_values(config.hidden_size, config.intermediate_size)
    return decoder_footprint(
        module,
        lambda _i, _layer: values,
        loss_chunk_size=config.loss_chunk_size,
        vocab_size=config.vocab_size,
        op_values=lambda _i, _layer: ops,
    )


def attention_splits(config: Qwen3Config) -> list[MeshSplit]:
    return [
        MeshSplit("num_attention_heads", config.num_attention_heads, "tensor_parallel"),
        MeshSplit("num_kv_heads", config.num_kv_heads, "tensor_parallel"),
    ]


def mesh_splits(config: Qwen3Config) -> list[MeshSplit]:
    return [
        *attention_splits(config),
        MeshSplit("intermediate_size", config.intermediate_size, "tensor_parallel"),
    ]


def build_causal_lm(config: Qwen3Config, stage: PipelineStageInfo | None) -> nn.Module:
    return Qwen3ForCausalLM(config, stage)


QWEN3 = ModelFamily(
    name="qwen3",
    config_class=Qwen3Config,
    build_causal_lm=build_causal_lm,
    parallelize=family_parallelize,
    flops_per_token=flops_per_token,
    stage_costs=stage_costs,
    footprint=footprint,
    mesh_splits=mesh_splits,
    hf=QWEN3_HF,
    description="Qwen3 dense: GQA with per-head q/k norms, SwiGLU, optional sliding windows",
)
