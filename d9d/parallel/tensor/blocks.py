"""Tensor parallelism for the transformer blocks (attention, SwiGLU, MoE, norms).

The projections' weights are stored as DTensors on the tp mesh (column-split `Shard(0)`, row-split
`Shard(1)`: checkpoints, FSDP and the optimizers see the split), but the block computes on this rank's local
tensors (`d9d.parallel.local_params`) with explicit collectives (`d9d.parallel.tensor.comm`), Megatron-style:
- a block's input enters the tensor-parallel region (`enter_tp_region`): passed as is with its gradient
  summed over tp, or all-gathered along the sequence under sequence parallelism (its gradient
  reduce-scattered back);
- column-split projections (q/k/v, gate/up; `shard_columns`) compute this rank's heads / intermediate
  columns; attention derives its local head count from their outputs;
- row-split output projections (o, down; `shard_rows`) sum their partial products: all-reduce, or
  reduce-scatter along the sequence under sequence parallelism, then add the bias once.
A compiled block (d9d.parallel.compile) therefore sees plain tensors only: DTensor parameters in the graph
cost every call the subclass wrapping of AOTAutograd's runtime wrapper and DTensor dispatch around it, which
left the TP 2 step host-bound at 0.35-0.44 of one GPU's throughput (docs/benchmarks.md, session 27).

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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from d9d.modules.attention import GroupedQueryAttention
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe import MoELayer
from d9d.modules.norm import RMSNorm
from d9d.parallel.local_params import compute_with_local_parameters, sum_gradients_over
from d9d.parallel.tensor.comm import (
    copy_to_group,
    gather_from_group,
    gather_sum_grad,
    reduce_from_group,
    scatter_sum,
    split_to_group,
)


def _distribute(
    linear: nn.Linear, tp_mesh: DeviceMesh, placements: dict[str, Placement], trigger: nn.Module
) -> None:
    names = set()
    for name, placement in placements.items():
        param = linear._parameters.get(name)
        if param is None:
            continue
        if isinstance(param, DTensor):
            raise ValueError(f"{type(linear).__name__}.{name} is already distributed as {param.placements}")
        sharded = distribute_tensor(param.detach(), tp_mesh, [placement])
        linear._parameters[name] = nn.Parameter(sharded, requires_grad=param.requires_grad)
        names.add(name)
    compute_with_local_parameters(linear, names, triggers=[trigger])


def shard_columns(linear: nn.Linear, tp_mesh: DeviceMesh, *, trigger: nn.Module | None = None) -> None:
    """Split `linear`'s output features (and bias) over `tp_mesh`: its forward computes this rank's columns.
    Its input must be whole on every rank with its gradient summed over tp (`enter_tp_region`).

    `trigger`: the module whose forward swaps the local tensors in (the compiled block; default `linear`)."""
    _distribute(linear, tp_mesh, {"weight": Shard(0), "bias": Shard(0)}, trigger or linear)


class RowParallelLinear(nn.Linear):
    """`nn.Linear` over this rank's input features: the partial products are summed over tp (all-reduce, or
    reduce-scatter along the sequence under sequence parallelism), then the bias is added once."""

    tp_group: dist.ProcessGroup
    sequence_parallel: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = scatter_sum(partial, 1, self.tp_group)
        else:
            out = reduce_from_group(partial, self.tp_group)
        return out if self.bias is None else out + self.bias


def shard_rows(
    linear: nn.Linear,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    trigger: nn.Module | None = None,
) -> None:
    """Split `linear`'s input features over `tp_mesh` (its input: the column-split projections' output); the
    output is summed over tp, whole on every rank or sequence-sharded (dim 1) under sequence parallelism."""
    trigger = trigger or linear
    _distribute(linear, tp_mesh, {"weight": Shard(1), "bias": Replicate()}, trigger)
    if sequence_parallel and linear.bias is not None:
        # each rank adds the bias to its own tokens only
        sum_gradients_over(linear, {"bias"}, tp_mesh.get_group(), trigger=trigger)
    linear.__class__ = RowParallelLinear
    assert isinstance(linear, RowParallelLinear)
    linear.tp_group = tp_mesh.get_group()
    linear.sequence_parallel = sequence_parallel


def enter_tp_region(module: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> None:
    """`module`'s first input becomes the whole activation its column-split projections read: all-gathered
    along the sequence under sequence parallelism (its gradient reduce-scattered back), else passed as is
    with its gradient summed over tp (each rank's columns contribute a part of it)."""
    group = tp_mesh.get_group()

    def enter(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = gather_sum_grad(args[0], 1, group) if sequence_parallel else copy_to_group(args[0], group)
        return (x, *args[1:])

    module.register_forward_pre_hook(enter)


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
    trigger = unit or attention
    enter_tp_region(attention, tp_mesh, sequence_parallel=sequence_parallel)
    for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
        shard_columns(proj, tp_mesh, trigger=trigger)
    shard_rows(attention.o_proj, tp_mesh, sequence_parallel=sequence_parallel, trigger=trigger)
    for norm in (attention.q_norm, attention.k_norm):
        if norm is not None:
            sum_gradients_over(norm, {"weight"}, tp_mesh.get_group(), trigger=trigger)


def parallelize_swiglu_tp(
    mlp: SwiGLU, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False, unit: nn.Module | None = None
) -> None:
    """Column-split gate/up, row-split down over `tp_mesh`. `unit`: as for `parallelize_attention_tp`."""
    tp = tp_mesh.size()
    if mlp.gate_proj.out_features % tp:
        raise ValueError(f"intermediate size {mlp.gate_proj.out_features} is not divisible by tp={tp}")
    trigger = unit or mlp
    enter_tp_region(mlp, tp_mesh, sequence_parallel=sequence_parallel)
    shard_columns(mlp.gate_proj, tp_mesh, trigger=trigger)
    shard_columns(mlp.up_proj, tp_mesh, trigger=trigger)
    shard_rows(mlp.down_proj, tp_mesh, sequence_parallel=sequence_parallel, trigger=trigger)


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
