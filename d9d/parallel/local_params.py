"""Let a module compute with the local shards of some of its DTensor parameters.

Parameters are stored as DTensors so checkpoints and optimizers see the topology, but most model code
(grouped matmuls, attention kernels, index ops) should run on plain tensors: DTensor dispatch is slow and
not every op has a sharding rule. While the module's forward runs, the named parameters are swapped for
their local tensors (`to_local()`, which is differentiable, so gradients still land on the DTensor
parameters with the parameter's placements) and swapped back right after, even when forward raises.

Limit: only the module's own forward sees local tensors; code elsewhere reading the parameter (e.g. a tied
weight used by another module) sees the DTensor.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

_ATTR = "_d9d_local_param_names"


def compute_with_local_parameters(module: nn.Module, names: set[str]) -> None:
    """From now on `module.forward` sees the direct DTensor parameters `names` as local tensors."""
    for name in names:
        if not isinstance(module._parameters.get(name), DTensor):
            raise TypeError(f"{type(module).__name__}.{name} is not a DTensor parameter")
    existing: set[str] | None = module.__dict__.get(_ATTR)
    if existing is not None:
        existing.update(names)
        return
    local_names = set(names)
    module.__dict__[_ATTR] = local_names
    stash: list[dict[str, Any]] = []  # a stack: a module may be re-entered (recursion, recomputation)

    def swap_in(mod: nn.Module, args: Any) -> None:
        originals = {name: mod._parameters[name] for name in local_names}
        stash.append(originals)
        for name, param in originals.items():
            mod._parameters[name] = param.to_local()  # type: ignore[union-attr,assignment]

    def swap_back(mod: nn.Module, args: Any, output: Any) -> None:
        if stash:
            mod._parameters.update(stash.pop())

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_back, always_call=True)
