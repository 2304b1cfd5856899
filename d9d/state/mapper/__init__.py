"""Graph-based state mapping: declare how checkpoint keys become model keys, apply it group by group.

API summary (all importable from `d9d.state.mapper` and `d9d.state`):

- contract: `StateGroup(inputs, outputs)`, `StateMapper` (ABC: `groups()`, `apply(group, tensors)`,
  `inverse()`, `inputs()`, `outputs()`), `apply_group` (apply with the contract checked),
  `TableMapper` (base for custom leaves), `StateMappingError`.
- key leaves: `Identity(keys)`, `Rename({src: dst})`, `Duplicate(src, [dst, ...])`, `Drop(keys)`,
  `strip_prefix(prefix, keys)`, `add_prefix(prefix, keys)`, `select_prefix(prefix, keys, strip=False)`.
- tensor leaves: `Stack(srcs, dst, dim)` / `Unstack(src, dsts, dim)`, `Concat(srcs, dst, dim, sizes)` /
  `Split(src, dsts, dim, sizes)`, `Transpose(keys, dim0, dim1)`, `Cast(keys, dtype)`,
  `Function(srcs, dsts, fn, inverse_fn)`.
- DTensor leaves: `Distribute({key: ShardingSpec(mesh, placements)})`, `Gather(keys or specs)`.
- composition: `Sequential([m1, m2, ...])` (stages; untouched keys pass through), `Parallel([...])`
  (disjoint keys), `Graph([...])` (DAG ordered by key names), `Prefixed(prefix, m, on=...)`,
  `Shard(m, num_shards, index)`, `Select(m, outputs=keys | inputs=keys)` (what one rank needs).
- from a module: `identity_mapper`, `distribute_mapper`, `gather_mapper`,
  `load_mapper(module, ckpt_to_model)`, `save_mapper(module, model_to_ckpt)`.

Example: HF per-expert weights -> one stacked tensor, q/k/v -> qkv, everything else renamed::

    layer = Parallel([
        Stack([f"mlp.experts.{e}.down_proj.weight" for e in range(E)], "mlp.experts.down", dim=0),
        Concat(["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
               "attn.qkv.weight", dim=0, sizes=[q, kv, kv]),
        Rename({"input_layernorm.weight": "norm1.weight"}),
    ])
    hf_to_d9d = Parallel([Prefixed(f"model.layers.{i}.", layer, on="input") ... ])  # etc.
    d9d_to_hf = hf_to_d9d.inverse()
"""

from d9d.state.errors import StateMappingError
from d9d.state.mapper.base import StateGroup, StateMapper, TableMapper, apply_group, check_groups
from d9d.state.mapper.compose import CompositeMapper, Graph, Parallel, Sequential
from d9d.state.mapper.dtensor import Distribute, Gather, ShardingSpec
from d9d.state.mapper.keys import Drop, Duplicate, Identity, Rename, add_prefix, select_prefix, strip_prefix
from d9d.state.mapper.module import (
    distribute_mapper,
    gather_mapper,
    identity_mapper,
    load_mapper,
    save_mapper,
)
from d9d.state.mapper.scope import Prefixed, Select, Shard
from d9d.state.mapper.tensor_ops import Cast, Concat, Function, Split, Stack, Transpose, Unstack

__all__ = [
    "Cast",
    "CompositeMapper",
    "Concat",
    "Distribute",
    "Drop",
    "Duplicate",
    "Function",
    "Gather",
    "Graph",
    "Identity",
    "Parallel",
    "Prefixed",
    "Rename",
    "Select",
    "Sequential",
    "Shard",
    "ShardingSpec",
    "Split",
    "Stack",
    "StateGroup",
    "StateMapper",
    "StateMappingError",
    "TableMapper",
    "Transpose",
    "Unstack",
    "add_prefix",
    "apply_group",
    "check_groups",
    "distribute_mapper",
    "gather_mapper",
    "identity_mapper",
    "load_mapper",
    "save_mapper",
    "select_prefix",
    "strip_prefix",
]
