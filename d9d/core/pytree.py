"""Helpers for nested batches: split a batch into microbatches, shard it across ranks, and merge back.

Every tensor leaf is split along `dim`; non-tensor leaves (strings, ints, None) are copied into every
piece, because they describe the batch rather than hold one element per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils import _pytree

from d9d.core.types import PyTree


def tree_map_tensors(fn: Callable[[torch.Tensor], object], tree: PyTree) -> PyTree:
    """Apply `fn` to every tensor leaf, leaving other leaves untouched."""
    return _pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, tree)


def tree_to(tree: PyTree, device: torch.device | str, non_blocking: bool = False) -> PyTree:
    return tree_map_tensors(lambda t: t.to(device, non_blocking=non_blocking), tree)


def tree_flatten(tree: PyTree) -> tuple[list[object], _pytree.TreeSpec]:
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: Sequence[object], spec: _pytree.TreeSpec) -> PyTree:
    return _pytree.tree_unflatten(list(leaves), spec)


def _batch_size(leaves: list[object], dim: int) -> int:
    sizes = {leaf.shape[dim] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > dim}
    if len(sizes) > 1:
        raise ValueError(f"tensor leaves disagree on the size of dim {dim}: {sorted(sizes)}")
    if not sizes:
        raise ValueError(f"the tree has no tensor leaf with a dim {dim} to split")
    return sizes.pop()


def tree_split(tree: PyTree, num_pieces: int, dim: int = 0, *, even: bool = True) -> list[PyTree]:
    """Split every tensor leaf into `num_pieces` along `dim` (e.g. a batch into microbatches).

    With `even=True` the size along `dim` must divide exactly: an uneven split silently changes the
    loss weighting, so it is refused unless asked for.
    """
    if num_pieces < 1:
        raise ValueError(f"num_pieces must be >= 1, got {num_pieces}")
    leaves, spec = tree_flatten(tree)
    size = _batch_size(leaves, dim)
    if even and size % num_pieces != 0:
        raise ValueError(f"cannot split size {size} along dim {dim} evenly into {num_pieces} pieces")
    if size < num_pieces:
        raise ValueError(f"cannot split size {size} along dim {dim} into {num_pieces} non-empty pieces")
    split_leaves = [
        list(torch.tensor_split(leaf, num_pieces, dim=dim))
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim
        else [leaf] * num_pieces
        for leaf in leaves
    ]
    return [tree_unflatten([parts[i] for parts in split_leaves], spec) for i in range(num_pieces)]


def tree_shard(tree: PyTree, num_shards: int, shard_index: int, dim: int = 0, *, even: bool = True) -> PyTree:
    """This shard's piece of the tree: contiguous chunks, shard `i` gets chunk `i`."""
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index {shard_index} is outside [0, {num_shards})")
    return tree_split(tree, num_shards, dim, even=even)[shard_index]


def tree_cat(trees: Sequence[PyTree], dim: int = 0) -> PyTree:
    """Inverse of `tree_split`: concatenate tensor leaves; other leaves are taken from the first tree."""
    if not trees:
        raise ValueError("tree_cat needs at least one tree")
    flat = [tree_flatten(t) for t in trees]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise ValueError(f"tree {i} has a different structure than tree 0")
    merged = []
    for parts in zip(*(leaves for leaves, _ in flat), strict=True):
        first = parts[0]
        if isinstance(first, torch.Tensor) and first.dim() > dim:
            merged.append(torch.cat([p for p in parts if isinstance(p, torch.Tensor)], dim=dim))
        else:
            merged.append(first)
    return tree_unflatten(merged, spec)
