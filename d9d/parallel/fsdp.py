"""Fully sharded data parallelism on FSDP2 (`fully_shard`), and HSDP on top of the gradient synchronizer.

FSDP2 shards parameters over the shard mesh, all-gathers them around each unit's forward/backward and
reduce-scatters gradients. It is configured to *sum* (gradient divide factor 1, sum-only collectives),
because normalization belongs to the synchronizer's loss-weight step, which also keeps gloo working (it
has no AVG or PREMUL_SUM).

HSDP: FSDP's own replicate support would all-reduce inside FSDP with its own averaging. Instead FSDP
only gets the shard mesh, and each sharded parameter is recorded for reduction over the replicate mesh.
FSDP2 calls post-accumulate-grad hooks on the sharded parameter right after its reduce-scatter, so the
synchronizer's bucket all-reduce over the replicate mesh starts during backward, exactly as for
replicated parameters.

Parameters whose gradient reduction is already decided (experts sharded by expert parallelism) are
passed to FSDP as ignored: they live on the expert mesh, which FSDP cannot combine with the dense one.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from d9d.parallel.grad_sync import is_grad_reduce_marked, mark_grad_reduce_mesh


def _decided_params(module: nn.Module) -> set[nn.Parameter]:
    return {
        param
        for sub in module.modules()
        for name, param in sub.named_parameters(recurse=False)
        if is_grad_reduce_marked(sub, name)
    }


def parallelize_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    units: Iterable[nn.Module] = (),
    replicate_mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Shard `module`'s parameters over the 1-D `mesh` (e.g. the dense domain's `dp_cp_shard`).

    `units` (e.g. the decoder layers) each become one FSDP group, gathered just for their own compute;
    whatever they do not cover belongs to the root group. With `replicate_mesh`, shards are replicated over
    it and their gradients summed by the synchronizer (that is HSDP; see `parallelize_hsdp`).
    """
    if mesh.ndim != 1:
        raise ValueError(f"parallelize_fsdp needs a 1-D shard mesh, got dims {mesh.mesh_dim_names}")
    for unit in [*units, module]:
        fsdp_module: FSDPModule = fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy or MixedPrecisionPolicy(),
            ignored_params=_decided_params(unit) or None,
        )
        fsdp_module.set_gradient_divide_factor(1.0)
        fsdp_module.set_force_sum_reduction_for_comms(True)
    for sub in module.modules():
        for name, _ in sub.named_parameters(recurse=False):
            if not is_grad_reduce_marked(sub, name):
                mark_grad_reduce_mesh(sub, name, replicate_mesh)


def parallelize_hsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    units: Iterable[nn.Module] = (),
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Hybrid sharding over a 2-D `(replicate, shard)` mesh, e.g. the dense domain's
    `("dp_cp_replicate", "dp_cp_shard")`: FSDP over the second dim, replicas over the first."""
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or names is None:
        raise ValueError(f"parallelize_hsdp needs a named 2-D (replicate, shard) mesh, got dims {names}")
    parallelize_fsdp(
        module,
        mesh[names[1]],
        units=units,
        replicate_mesh=mesh[names[0]],
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
    )
