"""Gradient synchronization: bucketed, backward-overlapped all-reduce over each parameter's replicate mesh."""

from d9d.parallel.grad_sync.bucket import GradBucket
from d9d.parallel.grad_sync.config import GradSyncConfig
from d9d.parallel.grad_sync.from_context import build_gradient_synchronizer, pipeline_group
from d9d.parallel.grad_sync.reduce_mesh import (
    SyncedParam,
    collect_synced_params,
    grad_reduce_dtype,
    grad_reduce_mesh,
    is_grad_reduce_marked,
    mark_grad_reduce_dtype,
    mark_grad_reduce_mesh,
    mark_no_grad_reduction,
    mark_undecided_grad_reduction,
    unsynced_params,
)
from d9d.parallel.grad_sync.synchronizer import GradientSynchronizer, mesh_group

__all__ = [
    "GradBucket",
    "GradSyncConfig",
    "GradientSynchronizer",
    "SyncedParam",
    "build_gradient_synchronizer",
    "collect_synced_params",
    "grad_reduce_dtype",
    "grad_reduce_mesh",
    "is_grad_reduce_marked",
    "mark_grad_reduce_dtype",
    "mark_grad_reduce_mesh",
    "mark_no_grad_reduction",
    "mark_undecided_grad_reduction",
    "mesh_group",
    "pipeline_group",
    "unsynced_params",
]
