"""Wiring the synchronizer and the norm to the topology of a `DistributedContext`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from d9d.core import DistributedContext, MeshDomain
from d9d.parallel.grad_sync.config import GradSyncConfig
from d9d.parallel.grad_sync.reduce_mesh import collect_synced_params
from d9d.parallel.grad_sync.synchronizer import GradientSynchronizer


def build_gradient_synchronizer(
    model: nn.Module,
    ctx: DistributedContext,
    config: GradSyncConfig | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    num_microbatches: int = 1,
) -> GradientSynchronizer:
    """A synchronizer for an already parallelized `model`; loss weights are summed over the ranks that
    hold different data (the batch domain's `dp` and `cp` dims: tp ranks share theirs, pp stages too)."""
    return GradientSynchronizer(
        collect_synced_params(model, optimizer),
        config,
        num_microbatches=num_microbatches,
        loss_weight_mesh=ctx.mesh_for(MeshDomain.BATCH)["dp", "cp"],
    )


def pipeline_group(ctx: DistributedContext) -> dist.ProcessGroup | None:
    """The pipeline-parallel group for `global_grad_norm` / `clip_grad_norm_` (None without pp)."""
    if ctx.params.pipeline_parallel == 1:
        return None
    return ctx.mesh_for(MeshDomain.REGULAR)["pp"].get_group()
