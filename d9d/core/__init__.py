"""Distributed core: mesh parameters, the DistributedContext, collectives and pytree helpers."""

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
