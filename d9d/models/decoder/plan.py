"""The parallelization plan of a decoder stage model whose layers are pre-norm attention + feed-forward
(Qwen3, Qwen3-MoE, Llama 3), driven by a `DistributedContext`. A family with other layers passes its own
per-layer tensor-parallel function (`layer_tp`).

Order matters and is fixed here:
1. expert parallelism (experts → `Shard(0)` on `ep_shard`, reduced over `ep_replicate`); with ep 1 and
   tp 1 the experts are left to step 3 and sharded by FSDP like every other weight,
2. tensor parallelism on the `tp` dim of the dense domain (heads, SwiGLU, vocabulary, token-split MoE),
3. data parallelism of everything else over the dense domain: FSDP on `dp_cp_shard` when it is larger than
   one (HSDP with the synchronizer reducing over `dp_cp_replicate`), plain replication otherwise. FSDP's
   units, in forward order: the embedding, each decoder layer, the head (embedding and head stay in the
   root group when they share weights); the root keeps the rest (the final norm). A separate head is
   reduce-scattered as soon as its backward ends, overlapping the layers' backward, instead of with the
   root after the whole backward; `config.fsdp` sets resharding, reduce dtype and prefetching.
After that, `build_gradient_synchronizer(model, ctx)` finds every parameter's reduce mesh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from d9d.core import DistributedContext, MeshDomain
from d9d.models.decoder.tasks import DecoderStageModel
from d9d.modules.attention import GroupedQueryAttention
from d9d.modules.heads import CausalLMHead
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe import MoELayer
from d9d.modules.norm import RMSNorm
from d9d.parallel.context import ContextParallelGroup, parallelize_context_attention
from d9d.parallel.expert import parallelize_expert_parallel
from d9d.parallel.fsdp import FSDPUnit, fsdp_gathered_bytes, parallelize_fsdp, parallelize_hsdp
from d9d.parallel.grad_sync import mark_no_grad_reduction
from d9d.parallel.plans.config import ParallelPlanConfig
from d9d.parallel.replicate import parallelize_replicate, replicate_plain
from d9d.parallel.tensor import (
    gather_from_group,
    parallelize_attention_tp,
    parallelize_moe_tp,
    parallelize_norm_tp,
    parallelize_swiglu_tp,
    parallelize_vocab_embedding,
    parallelize_vocab_head,
    split_to_group,
)

logger = logging.getLogger(__name__)


class PreNormLayer(Protocol):
    """A decoder layer as the default tensor-parallel function sees it (`Qwen3DecoderLayer`, ...)."""

    input_layernorm: RMSNorm
    self_attn: nn.Module
    post_attention_layernorm: RMSNorm
    mlp: nn.Module


LayerTensorParallel = Callable[[nn.Module, DeviceMesh, bool], None]
"""Shards one decoder layer over the tp mesh (`layer, tp_mesh, sequence_parallel`)."""


def tensor_parallel_prenorm_layer(layer: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Heads of a `GroupedQueryAttention`, a SwiGLU's intermediate columns, a token-split MoE, and the two
    norms (replicated; their gradients summed under sequence parallelism)."""
    sp = sequence_parallel
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    attention = getattr(layer, "self_attn", None)
    mlp = getattr(layer, "mlp", None)
    if not all(isinstance(n, RMSNorm) for n in norms) or not isinstance(attention, GroupedQueryAttention):
        raise TypeError(
            f"no tensor-parallel plan for {type(layer).__name__}: the default one needs RMSNorm "
            "input_layernorm / post_attention_layernorm and a GroupedQueryAttention self_attn"
        )
    assert isinstance(norms[0], RMSNorm) and isinstance(norms[1], RMSNorm)
    # `unit=layer`: gradient-summing views swap in around the block, outside its compiled forward
    parallelize_norm_tp(norms[0], tp_mesh, sequence_parallel=sp, unit=layer)
    parallelize_attention_tp(attention, tp_mesh, sequence_parallel=sp, unit=layer)
    parallelize_norm_tp(norms[1], tp_mesh, sequence_parallel=sp, unit=layer)
    if isinstance(mlp, MoELayer):
        parallelize_moe_tp(mlp, tp_mesh, sequence_parallel=sp, unit=layer)
    elif isinstance(mlp, SwiGLU):
        parallelize_swiglu_tp(mlp, tp_mesh, sequence_parallel=sp, unit=layer)
    else:
        raise TypeError(f"no tensor-parallel plan for feed-forward {type(mlp).__name__}")


def parallelize_decoder(
    model: DecoderStageModel,
    ctx: DistributedContext,
    config: ParallelPlanConfig | None = None,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    activation_dtype: torch.dtype | None = None,
    layer_tp: LayerTensorParallel = tensor_parallel_prenorm_layer,
) -> None:
    """Apply expert, tensor and data parallelism to one pipeline stage of a decoder task model.

    Works for any mix of `data_parallel_replicate × data_parallel_shard × context_parallel × expert_parallel ×
    tensor_parallel` (context parallel ranks share the data-parallel dims of the dense domain, so their
    gradients are reduced with the dp ranks'; attention gathers keys/values over cp).
    Sequence parallelism needs the sequence length divisible by tp; under pipeline parallelism a stage
    that is not the last gathers the sequence back before its boundary, so stage boundaries carry full
    sequences as without it. `mp_policy` is handed to FSDP when the plan shards.

    The expert-parallel backend is chosen for activations on `ctx.device` in `activation_dtype` (default:
    `mp_policy.param_dtype` when set, else the model's floating-point parameter dtype, which a model built
    on `meta` already has).
    """
    config = config or ParallelPlanConfig()
    sequence_parallel = config.sequence_parallel
    layers = list(model.model.decoder_layers().values())
    moe = [(layer, mlp) for layer in layers if isinstance(mlp := getattr(layer, "mlp", None), MoELayer)]
    if ctx.params.context_parallel > 1:
        # Batches arrive split by `d9d.parallel.context.shard_microbatch`; attention spans the whole sequence.
        head = model.head()
        if head is not None and not isinstance(head, CausalLMHead):
            raise ValueError(
                f"context parallelism splits the sequence, but the {type(head).__name__} of "
                f"{type(model).__name__} pools over it; it supports per-token (causal LM) heads only"
            )
        backbone = model.model
        cp = ContextParallelGroup.from_context(ctx)
        backbone.attention_backend = parallelize_context_attention(backbone, cp, backbone.attention_backend)
        for _, mlp in moe:
            mlp.shares_tokens_with(cp.group)  # each cp rank routes its part of the sequences
    # Experts that are dense weights (no ep, no tp) are left to data parallelism below: FSDP gathers them
    # for their block's forward and reduce-scatters them after its backward, prefetched. On the expert mesh
    # their gradients were all-reduced and their optimizer state replicated (2 x H200, FSDP 2: 36.3 against
    # 31.4 GiB at the same speed, docs/benchmarks.md, session 24). Otherwise ep or tp is above 1, and so is
    # the expert mesh.
    if moe and not ctx.params.experts_are_dense_weights:
        expert_mesh = ctx.mesh_for(MeshDomain.EXPERT)["ep_replicate", "ep_shard"]
        dtype = activation_dtype or _compute_dtype(model, mp_policy)
        for layer, mlp in moe:
            parallelize_expert_parallel(
                mlp,
                expert_mesh,
                device=ctx.device,
                dtype=dtype,
                backend=config.expert_backend,
                unit=layer,
            )
    dense = ctx.mesh_for(MeshDomain.DENSE)
    if dense["tp"].size() > 1:
        _tensor_parallel(model, layers, ctx, sequence_parallel, layer_tp)
    if dense["dp_cp_shard"].size() > 1:
        param_dtype = mp_policy.param_dtype if mp_policy is not None else None
        per_unit = config.fsdp.resolve_layers_per_unit(fsdp_gathered_bytes(model, param_dtype))
        logger.info(
            "fsdp: %d decoder layer(s) per unit (layers_per_unit %s)", per_unit, config.fsdp.layers_per_unit
        )
        units = fsdp_units(model, layers, per_unit)
        if dense["dp_cp_replicate"].size() > 1:
            parallelize_hsdp(
                model,
                dense["dp_cp_replicate", "dp_cp_shard"],
                units=units,
                config=config.fsdp,
                mp_policy=mp_policy,
            )
        else:
            parallelize_fsdp(
                model, dense["dp_cp_shard"], units=units, config=config.fsdp, mp_policy=mp_policy
            )
    elif any(isinstance(p, DTensor) for p in model.parameters()):
        # Tensor or expert parallelism made some parameters DTensors: torch's multi-tensor and fused
        # optimizers refuse a parameter group that mixes DTensors and plain tensors, so the rest become
        # DTensors too (replicated over the data-parallel mesh, of one rank or more).
        parallelize_replicate(model, dense["dp_cp_replicate"], units=layers)
    elif dense["dp_cp_replicate"].size() > 1:
        # Replicas of plain parameters: the synchronizer sums their gradients; no DTensor views per block
        # and microbatch (2 × H200, 2-sequence microbatches: docs/benchmarks.md, session 30).
        replicate_plain(model, dense["dp_cp_replicate"])
    else:
        # One data-parallel rank: no gradient is summed anywhere, so the parameters stay plain tensors. As
        # DTensors replicated over one rank they cost every step the views swapped around each block, a
        # synchronizer hook and bucket copy per gradient and a DTensor per gradient after backward (one
        # H200: the dense step went from 0.92-0.98x to 1.02-1.03x torchtitan's, docs/benchmarks.md).
        mark_no_grad_reduction(model)


def fsdp_units(model: DecoderStageModel, layers: list[nn.Module], layers_per_unit: int = 1) -> list[FSDPUnit]:
    """FSDP units of a stage in forward order: embedding (first stage), layers (`layers_per_unit`
    consecutive ones per unit, the last unit taking what is left), head (last stage); an embedding and
    head that share weights stay in the root group (FSDP refuses one parameter in two)."""
    embedding: nn.Module | None = model.model.embed_tokens
    task_head = model.head()
    head = task_head if isinstance(task_head, nn.Module) else None
    if embedding is not None and head is not None and _shares_parameters(embedding, head):
        embedding = head = None
    owning = [layer for layer in layers if _has_parameters(layer)]
    grouped: list[FSDPUnit] = [
        chunk[0] if len(chunk) == 1 else chunk
        for chunk in (owning[i : i + layers_per_unit] for i in range(0, len(owning), layers_per_unit))
    ]
    first: list[FSDPUnit] = [embedding] if embedding is not None and _has_parameters(embedding) else []
    last: list[FSDPUnit] = [head] if head is not None and _has_parameters(head) else []
    return [*first, *grouped, *last]


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _shares_parameters(a: nn.Module, b: nn.Module) -> bool:
    ids = {id(p) for p in a.parameters()}
    return any(id(p) in ids for p in b.parameters())


def _compute_dtype(model: nn.Module, mp_policy: MixedPrecisionPolicy | None) -> torch.dtype:
    if mp_policy is not None and mp_policy.param_dtype is not None:
        return mp_policy.param_dtype
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.get_default_dtype()


def _tensor_parallel(
    model: DecoderStageModel,
    layers: list[nn.Module],
    ctx: DistributedContext,
    sequence_parallel: bool,
    layer_tp: LayerTensorParallel,
) -> None:
    tp_mesh = ctx.mesh_for(MeshDomain.DENSE)["tp"]
    sp = sequence_parallel
    backbone = model.model
    group = tp_mesh.get_group()
    if backbone.embed_tokens is not None:
        parallelize_vocab_embedding(backbone.embed_tokens, tp_mesh)
    if sp and layers:
        # The backbone derives positions and masks from the replicated embedding output; the residual
        # stream is split along the sequence from the first decoder layer on.
        def split(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (split_to_group(args[0], 1, group), *args[1:])

        layers[0].register_forward_pre_hook(split)
        if backbone.norm is None:  # not the last stage: the next stage receives the whole sequence

            def gather_boundary(_m: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
                return gather_from_group(out, 1, group)

            backbone.register_forward_hook(gather_boundary)
    for layer in layers:
        layer_tp(layer, tp_mesh, sp)
    if backbone.norm is not None:
        parallelize_norm_tp(backbone.norm, tp_mesh, sequence_parallel=sp)
    for name, head in model.named_children():
        if name == "model" or head is None:
            continue
        if isinstance(head, CausalLMHead):
            parallelize_vocab_head(head, tp_mesh, sequence_parallel=sp)
        elif sp:  # other heads pool over the sequence: give them the whole of it

            def gather(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
                hidden: torch.Tensor = args[0]
                return (gather_from_group(hidden, 1, group), *args[1:])

            head.register_forward_pre_hook(gather)
