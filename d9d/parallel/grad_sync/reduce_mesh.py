"""Which mesh each parameter's gradient must be summed over, recorded by the strategies that know it.

A strategy that replicates a parameter (`parallelize_replicate`, the replicate dim of HSDP, the
`ep_replicate` dim of expert parallelism) records the mesh on the *owning module* under the parameter's
name, not on the parameter object: FSDP swaps parameter objects for sharded ones and late
initialization may rebuild them, while module names stay put. `collect_synced_params` resolves the
records against the parameters that exist when the synchronizer is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

_ATTR = "_d9d_grad_reduce_meshes"
_DTYPE_ATTR = "_d9d_grad_reduce_dtypes"


def mark_grad_reduce_mesh(module: nn.Module, name: str, mesh: DeviceMesh | None) -> None:
    """Record that the gradient of the direct parameter `module.<name>` is summed over all ranks of `mesh`.

    `None` records that it needs no reduction at all (e.g. experts sharded over every rank), so that a
    later, broader strategy such as `parallelize_replicate` leaves it alone.
    """
    if name not in module._parameters:
        raise KeyError(f"{type(module).__name__} has no direct parameter {name!r}")
    records: dict[str, DeviceMesh | None] = module.__dict__.setdefault(_ATTR, {})
    if name in records and records[name] != mesh:
        previous = records[name]
        raise ValueError(
            f"parameter {name!r} of {type(module).__name__} is already reduced over "
            f"{_describe(previous)}; a second strategy tried to reduce it over {_describe(mesh)}"
        )
    records[name] = mesh


def mark_undecided_grad_reduction(module: nn.Module, mesh: DeviceMesh | None) -> None:
    """Record `mesh` (None: no reduction) for every parameter of `module` (recursively) that no strategy
    has decided yet."""
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            if param is not None and not is_grad_reduce_marked(sub, name):
                mark_grad_reduce_mesh(sub, name, mesh)


def mark_no_grad_reduction(module: nn.Module) -> None:
    """Record "no reduction" for every parameter of `module` (recursively) that no strategy has decided
    yet: the layout has a single data-parallel rank, so its gradients are complete after backward."""
    mark_undecided_grad_reduction(module, None)


def mark_grad_reduce_dtype(module: nn.Module, name: str, dtype: torch.dtype) -> None:
    """Record that the gradient of `module.<name>` is reduced in at least `dtype` (e.g. float32 for bf16
    parameters whose FSDP reduce-scatter runs in float32): the synchronizer accumulates and all-reduces it
    in `dtype` or wider, so the replicate reduction of HSDP is not narrower than the shard reduction."""
    if name not in module._parameters:
        raise KeyError(f"{type(module).__name__} has no direct parameter {name!r}")
    module.__dict__.setdefault(_DTYPE_ATTR, {})[name] = dtype


def grad_reduce_dtype(module: nn.Module, name: str) -> torch.dtype | None:
    records: dict[str, torch.dtype] = module.__dict__.get(_DTYPE_ATTR, {})
    return records.get(name)


def _describe(mesh: DeviceMesh | None) -> str:
    return "no mesh" if mesh is None else f"mesh {mesh.mesh_dim_names}"


def is_grad_reduce_marked(module: nn.Module, name: str) -> bool:
    return name in module.__dict__.get(_ATTR, {})


def grad_reduce_mesh(module: nn.Module, name: str) -> DeviceMesh | None:
    records: dict[str, DeviceMesh | None] = module.__dict__.get(_ATTR, {})
    return records.get(name)


@dataclass(frozen=True)
class SyncedParam:
    """A parameter the synchronizer owns: its replicate mesh (None: nothing to reduce), optimizer group, and
    the narrowest dtype its gradient may be reduced in (None: whatever the synchronizer's config says)."""

    name: str
    param: nn.Parameter
    reduce_mesh: DeviceMesh | None
    group: int = 0
    reduce_dtype: torch.dtype | None = None


def collect_synced_params(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> list[SyncedParam]:
    """Every trainable parameter of `model` in registration order, with its recorded reduce mesh.

    With an optimizer, parameters it does not optimize are left out and each keeps its param-group index,
    so buckets never mix groups.
    """
    group_of: dict[int, int] | None = None
    if optimizer is not None:
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    out: list[SyncedParam] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param is None or not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if group_of is not None and id(param) not in group_of:
                continue
            full_name = f"{module_name}.{name}" if module_name else name
            group = group_of[id(param)] if group_of is not None else 0
            out.append(
                SyncedParam(
                    full_name, param, grad_reduce_mesh(module, name), group, grad_reduce_dtype(module, name)
                )
            )
    return out


def unsynced_params(model: nn.Module) -> list[str]:
    """Trainable parameters of `model` whose gradient reduction no strategy decided (neither a mesh nor
    "needs none" recorded): under data parallelism each replica would keep its own gradient and drift."""
    out = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if not is_grad_reduce_marked(module, name):
                out.append(f"{module_name}.{name}" if module_name else name)
    return out
