"""Horizontal parallelism: per-module strategies, gradient synchronization, global norm and clipping.

Strategies (apply in this order): `parallelize_expert_parallel` (d9d.parallel.expert), tensor parallelism
(d9d.parallel.tensor), then `parallelize_fsdp` / `parallelize_hsdp` / `parallelize_replicate`; or the
whole recipe of a model family (`d9d.models.<family>`, e.g. `parallelize_qwen3`). Then
`build_gradient_synchronizer` and, each step, `wait(loss_weight)` and `clip_grad_norm_`.
"""

from d9d.parallel.fsdp import FSDPConfig, parallelize_fsdp, parallelize_hsdp, reshard_fsdp
from d9d.parallel.grad_norm import clip_coefficient, clip_grad_norm_, global_grad_norm
from d9d.parallel.grad_sync import (
    GradientSynchronizer,
    GradSyncConfig,
    SyncedParam,
    build_gradient_synchronizer,
    collect_synced_params,
    grad_reduce_dtype,
    grad_reduce_mesh,
    is_grad_reduce_marked,
    mark_grad_reduce_dtype,
    mark_grad_reduce_mesh,
    pipeline_group,
)
from d9d.parallel.local_params import compute_with_local_parameters, sum_gradients_over
from d9d.parallel.replicate import parallelize_replicate, replicate_plain

__all__ = [
    "FSDPConfig",
    "GradSyncConfig",
    "GradientSynchronizer",
    "SyncedParam",
    "build_gradient_synchronizer",
    "clip_coefficient",
    "clip_grad_norm_",
    "collect_synced_params",
    "compute_with_local_parameters",
    "global_grad_norm",
    "grad_reduce_dtype",
    "grad_reduce_mesh",
    "is_grad_reduce_marked",
    "mark_grad_reduce_dtype",
    "mark_grad_reduce_mesh",
    "parallelize_fsdp",
    "parallelize_hsdp",
    "parallelize_replicate",
    "pipeline_group",
    "replicate_plain",
    "reshard_fsdp",
    "sum_gradients_over",
]
