"""The Llama 3 family spec: what the engine needs from Llama 3 (see `d9d.models.family`)."""

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
from d9d.models.llama3.config import Llama3Config
from d9d.models.llama3.hf import LLAMA3_HF
from d9d.models.llama3.tasks import Llama3ForCausalLM
from d9d.parallel.plans import ParallelPlanConfig
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.partition import StageCosts


def parallelize_llama3(
    model: DecoderStageModel,
    ctx: DistributedContext,
    config: ParallelPlanConfig | None = None,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    activation_dtype: torch.dtype | None = None,
) -> None:
    """Tensor (heads, SwiGLU columns, vocabulary; optional sequence parallelism), context (all-gathered keys
    and values) and data parallelism (replicate / FSDP / HSDP over the decoder layers) for one pipeline stage
    of a Llama 3 task model: `parallelize_decoder` with the pre-norm layer's tensor-parallel plan."""
    parallelize_decoder(model, ctx, config, mp_policy=mp_policy, activation_dtype=activation_dtype)


def _parallelize(
    module: nn.Module, ctx: DistributedContext, plan: ParallelPlanConfig, activation_dtype: torch.dtype | None
) -> None:
    if not isinstance(module, DecoderStageModel):
        raise TypeError(f"the Llama 3 plan parallelizes decoder task models, not {type(module).__name__}")
    parallelize_llama3(module, ctx, plan, activation_dtype=activation_dtype)


def stage_costs(config: Llama3Config, seq_len: int) -> StageCosts:
    h = config.hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    layers = [LayerCost(per_layer, q, q)] * config.num_layers
    return decoder_stage_costs(config.vocab_size, h, layers, seq_len)


def flops_per_token(config: Llama3Config, seq_len: int) -> float:
    return stage_costs(config, seq_len).total


def footprint(config: Llama3Config, module: nn.Module) -> StageFootprint | None:
    """Per layer and token about `8 × hidden + 3 × intermediate` values kept for backward; under op-level
    selective checkpointing the projections' and the attention's outputs."""
    h = config.hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_kv_heads * config.head_dim
    values = 8 * h + 3 * config.intermediate_size
    ops = (q + 2 * kv) + q + h + 2 * config.intermediate_size + h
    return decoder_footprint(
        module,
        lambda _i, _layer: values,
        loss_chunk_size=config.loss_chunk_size,
        vocab_size=config.vocab_size,
        op_values=lambda _i, _layer: ops,
    )


def mesh_splits(config: Llama3Config) -> list[MeshSplit]:
    return [
        MeshSplit("num_attention_heads", config.num_attention_heads, "tensor_parallel"),
        MeshSplit("num_kv_heads", config.num_kv_heads, "tensor_parallel"),
        MeshSplit("intermediate_size", config.intermediate_size, "tensor_parallel"),
    ]


def build_causal_lm(config: Llama3Config, stage: PipelineStageInfo | None) -> nn.Module:
    return Llama3ForCausalLM(config, stage)


LLAMA3 = ModelFamily(
    name="llama3",
    config_class=Llama3Config,
    build_causal_lm=build_causal_lm,
    parallelize=_parallelize,
    flops_per_token=flops_per_token,
    stage_costs=stage_costs,
    footprint=footprint,
    mesh_splits=mesh_splits,
    hf=LLAMA3_HF,
    description="Llama 3 dense: GQA, SwiGLU, RoPE with Llama 3.1 frequency scaling, tied or untied head",
)
