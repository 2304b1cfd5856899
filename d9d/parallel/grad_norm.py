"""Global gradient norm and clipping for parameters spread over several meshes.

A model under 6D parallelism holds gradients of many layouts at once: replicated dense weights, FSDP
shards on `dp_cp_shard`, TP shards on `tp`, experts on `ep_shard`, and a different slice of the model per
pipeline stage. `DTensor.full_tensor()` per parameter would gather whole gradients; instead each rank
sums |g|^p over its local shards per *layout group* (same mesh and same sharded dims), each group's partial
sum is reduced over exactly the dims it is sharded on (replicated dims hold copies and must not be
counted twice), the groups are added, and the total is reduced over pipeline stages. That costs one scalar
collective per group and sharded dim, and one for pp.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from d9d.core.dtensor import local_tensor
from d9d.parallel.grad_sync.bucket import scale_

_GroupKey = tuple[DeviceMesh | None, tuple[int, ...], torch.device]


def _layout_key(grad: torch.Tensor, name: str) -> _GroupKey:
    if not isinstance(grad, DTensor):
        return (None, (), grad.device)
    if any(p.is_partial() for p in grad.placements):
        raise ValueError(
            f"gradient of parameter {name} is Partial on mesh {grad.device_mesh.mesh_dim_names}: reduce it "
            "(GradientSynchronizer.wait) before computing its norm"
        )
    # Anything neither replicated nor partial splits the tensor: Shard, and FSDP-over-TP's _StridedShard
    # (which recent torch no longer derives from Shard).
    sharded = tuple(i for i, p in enumerate(grad.placements) if not (p.is_replicate() or p.is_partial()))
    return (grad.device_mesh, sharded, local_tensor(grad).device)


def _reduce_op(norm_type: float) -> dist.ReduceOp.RedOpType:
    return dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM


def _partial(local_grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    # Per tensor in at least float32 (bf16 gradients), combined in float64. One multi-tensor norm per
    # dtype instead of a kernel (and a host launch) per gradient: the dense step's 311 launches sat in the
    # gap between backward and the optimizer.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in local_grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    norms = torch.cat(
        [
            torch.stack(
                torch._foreach_norm(grads, norm_type, dtype=torch.promote_types(dtype, torch.float32))
            )
            .double()
            .flatten()
            for dtype, grads in by_dtype.items()
        ]
    )
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


def global_grad_norm(
    params: Iterable[torch.Tensor],
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The norm of all gradients of the whole (model-parallel) model, identical on every rank.

    Every rank of a shard group must pass its parameters in the same order; parameters without a gradient
    are skipped. `pp_group`: the pipeline-parallel group (None without pipeline parallelism).
    """
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive, got {norm_type}")
    groups: dict[_GroupKey, list[torch.Tensor]] = {}
    for i, param in enumerate(params):
        if param.grad is None:
            continue
        groups.setdefault(_layout_key(param.grad, f"#{i} {tuple(param.shape)}"), []).append(
            local_tensor(param.grad)
        )
    op = _reduce_op(norm_type)
    device: torch.device | None = None
    total: torch.Tensor | None = None
    for (mesh, sharded_dims, dev), grads in groups.items():
        part = _partial(grads, norm_type)
        if mesh is not None:
            for dim in sharded_dims:
                if mesh.size(dim) > 1:
                    dist.all_reduce(part, op=op, group=mesh.get_group(dim))
        if total is None:
            device, total = dev, part
        else:
            part = part.to(device)
            total = torch.maximum(total, part) if math.isinf(norm_type) else total + part
    if total is None:
        total = torch.zeros((), dtype=torch.float64, device=_pp_device(pp_group))
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        total = total.to(_pp_device(pp_group))
        dist.all_reduce(total, op=op, group=pp_group)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def _pp_device(pp_group: dist.ProcessGroup | None) -> torch.device:
    if pp_group is not None and "nccl" in str(dist.get_backend(pp_group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that clips gradients of global norm `norm` to `max_norm`: torch's `clip_grad_norm_`
    coefficient, max_norm / (norm + 1e-6) capped at 1."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale all gradients in place so their global norm is at most `max_norm`; returns the norm before.

    Same coefficient as `torch.nn.utils.clip_grad_norm_` (max_norm / (norm + 1e-6), capped at 1), so a
    distributed run clips exactly like a single-process one.
    """
    params = list(params)
    total = global_grad_norm(params, norm_type=norm_type, pp_group=pp_group)
    coef = clip_coefficient(total, max_norm)
    scale_([local_tensor(p.grad) for p in params if p.grad is not None], coef)
    return total
