"""Distributed core: mesh parameters, the DistributedContext, collectives and pytree helpers.

The names below are imported on first use (PEP 562): `d9d.core.storage` and `d9d.core.files`, which the
command line reads run directories with, must not pull in torch through this package."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from d9d.core.context import BackendChoice, DistributedContext, resolve_backend
    from d9d.core.dist_ops import (
        PendingResult,
        all_gather_object,
        all_gather_object_async,
        all_gather_varshape,
        all_gather_varshape_async,
        gather_object,
        gather_object_async,
        gather_varshape,
        gather_varshape_async,
    )
    from d9d.core.domains import DomainLayout, MeshDomain, compute_layout
    from d9d.core.mesh_params import PHYSICAL_DIMS, DeviceMeshParameters
    from d9d.core.pytree import tree_cat, tree_map_tensors, tree_shard, tree_split, tree_to

_EXPORTS = {
    "d9d.core.context": ("BackendChoice", "DistributedContext", "resolve_backend"),
    "d9d.core.dist_ops": (
        "PendingResult",
        "all_gather_object",
        "all_gather_object_async",
        "all_gather_varshape",
        "all_gather_varshape_async",
        "gather_object",
        "gather_object_async",
        "gather_varshape",
        "gather_varshape_async",
    ),
    "d9d.core.domains": ("DomainLayout", "MeshDomain", "compute_layout"),
    "d9d.core.mesh_params": ("PHYSICAL_DIMS", "DeviceMeshParameters"),
    "d9d.core.pytree": ("tree_cat", "tree_map_tensors", "tree_shard", "tree_split", "tree_to"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "PHYSICAL_DIMS",
    "BackendChoice",
    "DeviceMeshParameters",
    "DistributedContext",
    "DomainLayout",
    "MeshDomain",
    "PendingResult",
    "all_gather_object",
    "all_gather_object_async",
    "all_gather_varshape",
    "all_gather_varshape_async",
    "compute_layout",
    "gather_object",
    "gather_object_async",
    "gather_varshape",
    "gather_varshape_async",
    "resolve_backend",
    "tree_cat",
    "tree_map_tensors",
    "tree_shard",
    "tree_split",
    "tree_to",
]
