"""The DeepSeek-V3 family spec and parallelization plan (see `d9d.models.family`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from d9d.core import DistributedContext
from d9d.models.decoder import (
    DecoderStageModel,
    LayerCost,
    decoder_footprint,
    decoder_stage_costs,
    parallelize_decoder,
)
from d9d.models.deepseek_v3.attention import MultiHeadLatentAttention
from d9d.models.deepseek_v3.config import DeepSeekV3Config
from d9d.models.deepseek_v3.hf import DEEPSEEK_V3_HF
from d9d.models.deepseek_v3.tasks import DeepSeekV3ForCausalLM
from d9d.models.family import MeshSplit, ModelFamily, StageFootprint
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe import MoELayer
from d9d.modules.norm import RMSNorm
from d9d.parallel.plans import ParallelPlanConfig
from d9d.parallel.tensor import (
    copy_to_group,
    enter_tp_region,
    gather_from_group,
    parallelize_moe_tp,
    parallelize_norm_tp,
    parallelize_swiglu_tp,
    shard_columns,
    shard_rows,
)
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.partition import StageCosts


def parallelize_latent_attention_tp(
    attention: MultiHeadLatentAttention,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    unit: nn.Module | None = None,
) -> None:
    """Heads over `tp_mesh`: the per-head projections (`q_proj` or `q_b_proj`, `kv_b_proj`) split by columns,
    `o_proj` by rows; the low-rank down projections and their norms stay whole on every rank (their input
    is the whole hidden state, their output's gradient arrives summed from the column-split projections).
    The one rotary key feeds every rank's heads, so its gradient is summed over tp. `unit`: the compiled
    block holding `attention` (d9d.parallel.tensor.blocks); default `attention` itself."""
    tp = tp_mesh.size()
    per_head = attention.nope_dim + attention.v_dim
    heads = attention.kv_b_proj.out_features // per_head
    if heads % tp:
        raise ValueError(f"attention heads ({heads}) are not divisible by tp={tp}")
    group = tp_mesh.get_group()
    trigger = unit or attention
    if sequence_parallel:
        # every rank needs the whole sequence; the gradient arriving here is already whole (summed at the
        # column-split projections and the rotary key), so backward keeps this rank's chunk
        attention.register_forward_pre_hook(
            lambda _m, args: (gather_from_group(args[0], 1, group), *args[1:])
        )
    column_split = attention.q_proj if attention.q_proj is not None else attention.q_b_proj
    assert column_split is not None
    for proj in (column_split, attention.kv_b_proj):
        enter_tp_region(proj, tp_mesh)
        shard_columns(proj, tp_mesh, trigger=trigger)
    shard_rows(attention.o_proj, tp_mesh, sequence_parallel=sequence_parallel, trigger=trigger)
    attention.rope_key.register_forward_hook(lambda _m, _args, out: copy_to_group(out, group))


def tensor_parallel_layer(layer: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    sp = sequence_parallel
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        assert isinstance(norm, RMSNorm)
        # `unit=layer`: gradient-summing views swap in around the block, outside its compiled forward
        parallelize_norm_tp(norm, tp_mesh, sequence_parallel=sp, unit=layer)
    attention = layer.self_attn
    assert isinstance(attention, MultiHeadLatentAttention)
    parallelize_latent_attention_tp(attention, tp_mesh, sequence_parallel=sp, unit=layer)
    mlp = layer.mlp
    if isinstance(mlp, MoELayer):
        parallelize_moe_tp(mlp, tp_mesh, sequence_parallel=sp, unit=layer)
    else:
        assert isinstance(mlp, SwiGLU)
        parallelize_swiglu_tp(mlp, tp_mesh, sequence_parallel=sp, unit=layer)


def parallelize_deepseek_v3(
    model: DecoderStageModel,
    ctx: DistributedContext,
    config: ParallelPlanConfig | None = None,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    activation_dtype: torch.dtype | None = None,
) -> None:
    """Context parallelism (keys/values gathered over cp), expert parallelism of the routed experts, tensor
    parallelism (MLA heads, dense SwiGLU columns, token-split MoE layers, vocabulary), then data parallelism
    (replicate / FSDP / HSDP over the decoder layers): `parallelize_decoder` with the MLA layer's plan."""
    parallelize_decoder(
        model,
        ctx,
        config,
        mp_policy=mp_policy,
        activation_dtype=activation_dtype,
        layer_tp=tensor_parallel_layer,
    )
    backend = model.model.attention_backend
    for module in model.modules():  # the context-parallel backend (if any) reaches the latent attention too
        if isinstance(module, MultiHeadLatentAttention):
            module.backend = backend


def _parallelize(
    module: nn.Module, ctx: DistributedContext, plan: ParallelPlanConfig, activation_dtype: torch.dtype | None
) -> None:
    if not isinstance(module, DecoderStageModel):
        raise TypeError(f"the DeepSeek-V3 plan parallelizes decoder task models, not {type(module).__name__}")
    parallelize_deepseek_v3(module, ctx, plan, activation_dtype=activation_dtype)


def _attention_params(c: DeepSeekV3Config) -> int:
    h, heads = c.hidden_size, c.num_attention_heads
    q = h * heads * c.qk_head_dim if c.q_lora_rank is None else c.q_lora_rank * (h + heads * c.qk_head_dim)
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * heads * (
        c.qk_nope_head_dim + c.v_head_dim
    )
    return q + kv + heads * c.v_head_dim * h


def _ffn_width(c: DeepSeekV3Config, layer: int) -> int:
    """The SwiGLU width a token passes through: routed (top-k) plus shared experts in MoE layers."""
    if c.is_moe_layer(layer):
        return c.moe_intermediate_size * (c.num_experts_per_tok + c.num_shared_experts)
    return c.intermediate_size


def stage_costs(config: DeepSeekV3Config, seq_len: int) -> StageCosts:
    """Scores over `heads × qk_head_dim`, values over `heads × v_head_dim`; MoE layers count the routed
    top-k, the shared experts and the router."""
    c, h = config, config.hidden_size
    layers = [
        LayerCost(
            _attention_params(c) + 3 * h * _ffn_width(c, i) + (h * c.num_experts if c.is_moe_layer(i) else 0),
            c.num_attention_heads * c.qk_head_dim,
            c.num_attention_heads * c.v_head_dim,
        )
        for i in range(c.num_layers)
    ]
    return decoder_stage_costs(c.vocab_size, h, layers, seq_len)


def flops_per_token(config: DeepSeekV3Config, seq_len: int) -> float:
    return stage_costs(config, seq_len).total


def _op_values(c: DeepSeekV3Config, layer: int) -> int:
    """Per token, what op-level selective checkpointing keeps: the query path's projections (low-rank or
    full), the key/value latent and its expansion, the attention output, o_proj, and the SwiGLU projections
    (routed top-k plus shared experts and the router in MoE layers)."""
    h, heads = c.hidden_size, c.num_attention_heads
    query = heads * c.qk_head_dim + (c.q_lora_rank or 0)
    keys_values = c.kv_lora_rank + c.qk_rope_head_dim + heads * (c.qk_nope_head_dim + c.v_head_dim)
    attention = query + keys_values + heads * c.v_head_dim + h
    if c.is_moe_layer(layer):
        copies = c.num_experts_per_tok + (1 if c.num_shared_experts else 0)
        return attention + 2 * _ffn_width(c, layer) + copies * h + c.num_experts
    return attention + 2 * c.intermediate_size + h


def footprint(config: DeepSeekV3Config, module: nn.Module) -> StageFootprint | None:
    """Per layer and token about `8 × hidden + 3 × ffn` values (ffn: routed top-k plus shared width in MoE
    layers) plus the expanded queries, keys and values (`heads × (2 · qk_head_dim + v_head_dim)`); under
    op-level selective checkpointing `_op_values`."""
    c = config
    attention = c.num_attention_heads * (2 * c.qk_head_dim + c.v_head_dim)
    return decoder_footprint(
        module,
        lambda i, _layer: 8 * c.hidden_size + 3 * _ffn_width(c, i) + attention,
        loss_chunk_size=c.loss_chunk_size,
        vocab_size=c.vocab_size,
        op_values=lambda i, _layer: _op_values(c, i),
    )


def mesh_splits(config: DeepSeekV3Config) -> list[MeshSplit]:
    splits = [
        MeshSplit("num_attention_heads", config.num_attention_heads, "tensor_parallel"),
        MeshSplit("num_experts", config.num_experts, "expert_parallel"),
    ]
    if config.first_k_dense:
        splits.append(MeshSplit("intermediate_size", config.intermediate_size, "tensor_parallel"))
    return splits


def build_causal_lm(config: DeepSeekV3Config, stage: PipelineStageInfo | None) -> nn.Module:
    return DeepSeekV3ForCausalLM(config, stage)


DEEPSEEK_V3 = ModelFamily(
    name="deepseek_v3",
    config_class=DeepSeekV3Config,
    build_causal_lm=build_causal_lm,
    parallelize=_parallelize,
    flops_per_token=flops_per_token,
    stage_costs=stage_costs,
    footprint=footprint,
    mesh_splits=mesh_splits,
    hf=DEEPSEEK_V3_HF,
    description="DeepSeek-V3-style MoE: multi-head latent attention, shared + group-limited sigmoid-routed "
    "experts with the aux-loss-free bias, the first layers dense",
)
