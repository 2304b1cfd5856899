"""Horizontal parallelism: per-module strategies, gradient synchronization, global norm and clipping."""

from d9d.parallel.grad_norm import clip_grad_norm_, global_grad_norm
from d9d.parallel.grad_sync import (
    GradientSynchronizer,
    GradSyncConfig,
    SyncedParam,
    collect_synced_params,
    grad_reduce_mesh,
    mark_grad_reduce_mesh,
)
from d9d.parallel.local_params import compute_with_local_parameters
from d9d.parallel.replicate import parallelize_replicate

__all__ = [
    "GradSyncConfig",
    "GradientSynchronizer",
    "SyncedParam",
    "clip_grad_norm_",
    "collect_synced_params",
    "compute_with_local_parameters",
    "global_grad_norm",
    "grad_reduce_mesh",
    "mark_grad_reduce_mesh",
    "parallelize_replicate",
]
