"""`parallelize_expert_parallel`: shard an MoE layer's experts over `ep_shard`, exchange tokens."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from d9d.modules.moe.layer import MoELayer
from d9d.parallel.expert.all_to_all import AllToAllMoECommunication
from d9d.parallel.expert.backend import AutoBackendConfig, ExpertCommunicationConfig, build_moe_communication
from d9d.parallel.expert.capacity import ExchangeCapacity
from d9d.parallel.expert.deepep import DeepEPMoECommunication
from d9d.parallel.grad_sync import mark_grad_reduce_mesh
from d9d.parallel.local_params import compute_with_local_parameters


def parallelize_expert_parallel(
    moe_layer: MoELayer,
    expert_mesh: DeviceMesh,
    *,
    device: torch.device,
    dtype: torch.dtype,
    backend: ExpertCommunicationConfig | None = None,
    unit: nn.Module | None = None,
) -> None:
    """Keep 1/ep of the experts on each rank and route tokens to them.

    `expert_mesh` is the expert domain's `(ep_replicate, ep_shard)` mesh (or just an `ep_shard` mesh).
    Expert weights become DTensors `Shard(0)` over `ep_shard` (and `Replicate` over `ep_replicate`, whose
    gradient sum is left to the synchronizer); the experts compute on their local slice. The router and
    the shared expert are not touched: parallelize them like any dense module. With `ep_shard` of size 1
    the experts still become DTensors (replicated over `ep_replicate`) and keep the local dispatch.

    `device` and `dtype` are those of the activations at run time (the rank's device, the compute dtype),
    given by the caller: the layer's parameters may still be on `meta` here, and their dtype need not be
    the activations' under mixed precision. The communication backend is chosen from them.

    `unit` (the decoder block holding the layer) swaps in the experts' local views around its own forward
    instead of the experts' (see `parallelize_replicate`'s `units`: a compiled block then shares one graph).
    """
    names = expert_mesh.mesh_dim_names or ()
    if expert_mesh.ndim == 1:
        shard_mesh, replicate_mesh = expert_mesh, None
    elif expert_mesh.ndim == 2:
        shard_mesh, replicate_mesh = expert_mesh[names[1]], expert_mesh[names[0]]
    else:
        raise ValueError(f"expert_mesh must have 1 or 2 dims (ep_replicate, ep_shard), got {names}")
    experts = moe_layer.experts
    ep = shard_mesh.size()
    placements = [Shard(0)] if replicate_mesh is None else [Replicate(), Shard(0)]
    for name, param in list(experts.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            raise ValueError(f"experts.{name} is already a DTensor: apply expert parallelism first")
        if param.shape[0] % ep:
            raise ValueError(
                f"experts.{name} holds {param.shape[0]} experts, not divisible by ep_shard size {ep}"
            )
        sharded = distribute_tensor(param.detach(), expert_mesh, placements, src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        mark_grad_reduce_mesh(experts, name, replicate_mesh)
    compute_with_local_parameters(
        experts,
        {name for name, _ in experts.named_parameters(recurse=False)},
        triggers=[unit] if unit is not None else None,
    )
    if ep == 1:
        return  # every expert is local: the layer's own (local) communication is exact and free
    moe_layer.communication = build_moe_communication(
        backend if backend is not None else AutoBackendConfig(),
        shard_mesh.get_group(),
        device=device,
        dtype=dtype,
    )


def exchange_capacities(module: nn.Module) -> list[tuple[str, ExchangeCapacity]]:
    """The static capacities of the expert exchanges in `module`'s MoE layers, by qualified layer name, in
    module order: what a training loop must read after each step when any exist (`d9d.engine.exchange`)."""
    return [
        (name, m.communication.capacity)
        for name, m in module.named_modules()
        if isinstance(m, MoELayer)
        and isinstance(m.communication, AllToAllMoECommunication)
        and m.communication.capacity is not None
    ]


def release_expert_communication(module: nn.Module) -> None:
    """Release what `module`'s MoE layers' exchanges hold outside PyTorch's allocator (DeepEP's buffers). A
    barrier over each expert-parallel group: every rank calls it at the same point (the end of training)."""
    for m in module.modules():
        if isinstance(m, MoELayer) and isinstance(m.communication, DeepEPMoECommunication):
            m.communication.close()
