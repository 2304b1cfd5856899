"""Tensor parallelism for the transformer blocks (attention, SwiGLU, MoE, norms).

Linear layers use `torch.distributed.tensor.parallel`: the block input is turned into a replicated
DTensor once (all-gathered along the sequence under sequence parallelism), column-parallel projections
(q/k/v, gate/up) produce local head / intermediate shards, the row-parallel output projection (o, down)
sums them (all-reduce, or reduce-scatter along the sequence). Everything between runs on local tensors:
attention derives its local head count from the projection outputs.

Parameters replicated over tp whose input differs per tp rank get their gradient summed over tp
(`sum_gradients_over`): per-head q/k norms (each rank normalizes its own heads), block norms under
sequence parallelism (each rank normalizes its own tokens), and everything in a token-split MoE layer.
Their views are swapped in around the forward of `unit`, the decoder block, when given: a compiled block
traces its submodules' hooks, and per-submodule views made dynamo guard on each layer's own modules (one
graph per layer; 8 graphs on the 28-layer Qwen3-0.6B, then dynamo's recompile limit ran the other 20
layers eagerly, with DTensor dispatch).

MoE layers are not split by columns: each tp rank runs the layer on its share of the tokens (its
sequence chunk, which sequence parallelism already provides), so every token is routed exactly once in
the tp group and expert parallelism can span the tp ranks. Router and shared expert therefore act like
data-parallel replicas inside the tp group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from d9d.modules.attention import GroupedQueryAttention
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe import MoELayer
from d9d.modules.norm import RMSNorm
from d9d.parallel.local_params import sum_gradients_over
from d9d.parallel.tensor.comm import gather_from_group, split_to_group


def _block_input(sequence_parallel: bool, extra_args: int) -> PrepareModuleInput:
    layout = Shard(1) if sequence_parallel else Replicate()
    none: tuple[None, ...] = (None,) * extra_args
    return PrepareModuleInput(
        input_layouts=(layout, *none),
        desired_input_layouts=(Replicate(), *none),
        use_local_output=False,
    )


def _row_output(sequence_parallel: bool) -> RowwiseParallel:
    return RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())


def parallelize_attention_tp(
    attention: GroupedQueryAttention,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    unit: nn.Module | None = None,
) -> None:
    """Split heads over `tp_mesh` (num_heads and num_kv_heads must be divisible by its size).

    `unit`: the compiled block holding `attention` (see the module doc); default `attention` itself."""
    tp = tp_mesh.size()
    heads, kv_heads = (
        attention.q_proj.out_features // attention.head_dim,
        attention.k_proj.out_features // attention.head_dim,
    )
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"attention heads ({heads} query, {kv_heads} key/value) are not divisible by tp={tp}"
        )
    parallelize_module(attention, tp_mesh, _block_input(sequence_parallel, extra_args=2))
    parallelize_module(
        attention,
        tp_mesh,
        {
            "q_proj": ColwiseParallel(),
            "k_proj": ColwiseParallel(),
            "v_proj": ColwiseParallel(),
            "o_proj": _row_output(sequence_parallel),
        },
    )
    for norm in (attention.q_norm, attention.k_norm):
        if norm is not None:
            sum_gradients_over(norm, {"weight"}, tp_mesh.get_group(), trigger=unit or attention)


def parallelize_swiglu_tp(mlp: SwiGLU, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> None:
    """Column-split gate/up, row-split down over `tp_mesh`."""
    tp = tp_mesh.size()
    if mlp.gate_proj.out_features % tp:
        raise ValueError(f"intermediate size {mlp.gate_proj.out_features} is not divisible by tp={tp}")
    parallelize_module(mlp, tp_mesh, _block_input(sequence_parallel, extra_args=0))
    parallelize_module(
        mlp,
        tp_mesh,
        {
            "gate_proj": ColwiseParallel(),
            "up_proj": ColwiseParallel(),
            "down_proj": _row_output(sequence_parallel),
        },
    )


def parallelize_moe_tp(
    moe: MoELayer, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False, unit: nn.Module | None = None
) -> None:
    """Run `moe` on this tp rank's share of the tokens (sequence dim 1).

    Without sequence parallelism the replicated input is split along the sequence and the output
    gathered back. Apply expert parallelism first: experts that are still plain parameters get their
    gradient summed over tp like the router; expert-parallel ones are reduced over the expert mesh.
    """
    group = tp_mesh.get_group()
    moe.shares_tokens_with(group)  # the balancing loss over the whole sequences, as with tp 1
    for module in moe.modules():
        names = {
            name for name, param in module.named_parameters(recurse=False) if not isinstance(param, DTensor)
        }
        if names:
            sum_gradients_over(module, names, group, trigger=unit or moe)

    def split(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        # Tokens arrive split already under sequence parallelism; the optional token mask (args[1],
        # [batch, seq]) always arrives whole and must follow the tokens.
        hidden = args[0] if sequence_parallel else split_to_group(args[0], 1, group)
        if len(args) > 1 and args[1] is not None:
            return (hidden, split_to_group(args[1], 1, group), *args[2:])
        return (hidden, *args[1:])

    moe.register_forward_pre_hook(split)
    if sequence_parallel:
        return

    def gather(_module: nn.Module, _args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return gather_from_group(output, 1, group)

    moe.register_forward_hook(gather)


def parallelize_norm_tp(
    norm: RMSNorm, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False, unit: nn.Module | None = None
) -> None:
    """A block norm on the residual stream: nothing to do unless it sees only this rank's tokens."""
    if sequence_parallel:
        sum_gradients_over(norm, {"weight"}, tp_mesh.get_group(), trigger=unit or norm)
