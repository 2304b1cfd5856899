"""What a module's forward sees in place of some of its parameters.

Two needs share one mechanism:
- Parameters are stored as DTensors so checkpoints and optimizers see the topology, but most model code
  (grouped matmuls, attention kernels, index ops) should run on plain tensors: DTensor dispatch is slow
  and not every op has a sharding rule. `compute_with_local_parameters` shows forward the local tensor
  (`to_local()` is differentiable, so gradients land on the DTensor parameter with its placements).
- Some replicated parameters only see part of the data on each rank of a group (norm weights under
  sequence parallelism, per-head q/k norms under tensor parallelism, routers of token-split MoE layers),
  so their gradient is partial over that group. `sum_gradients_over` shows forward the parameter through
  an identity whose backward all-reduces the gradient over the group, so whoever consumes the gradient
  next (autograd accumulation, FSDP, the synchronizer) gets the full one.

While the module's forward runs, the parameters are swapped for these views and swapped back right after,
even when forward raises. Parameter containers (`nn.ParameterDict` / `nn.ParameterList`) have no forward
of their own: their parameters are swapped around the forward of the module that reads them (`trigger`).
Limit: other code reading a parameter outside those forwards sees the stored parameter.

Order matters: each summed gradient is an all-reduce issued from autograd, and once their inputs are ready
autograd runs these nodes in reverse order of creation, so every rank must create them in the same order or
it sums one parameter's gradient with another's (silently, where the sizes agree). Views are therefore
created in registration order with names sorted, never in the order of a set (string hashes and `id()`s
differ from process to process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor

_ATTR = "_d9d_forward_views"


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of `x` over `group` as a new tensor: torch's functional all-reduce, which traces into a
    compiled graph. Never an in-place `dist.all_reduce` of a tensor autograd handed over: inside a compiled
    backward on CUDA (inductor, NCCL) that gave wrong gradients (session 27, the TP 2 engine test on
    2 x H200)."""
    # the wait orders the consumer's stream after the collective (no host sync)
    out: torch.Tensor = funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))
    return out


class _SumGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        if torch.compiler.is_compiling():
            # dynamo refuses a custom Function's view output of a DTensor's `to_local()` view (view+inplace
            # rule); the parameters passed through here are small (norm weights, routers)
            return x.clone()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_sum(grad, ctx.group), None


def sum_gradient(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Identity whose backward sums the gradient over `group`."""
    out: torch.Tensor = _SumGradient.apply(x, group)
    return out


_Key = tuple[int, str]  # (id of the owning module, parameter name)


@dataclass
class _Views:
    owners: dict[int, nn.Module] = field(default_factory=dict)
    local: dict[_Key, None] = field(default_factory=dict)  # an ordered set: registration order
    grad_groups: dict[_Key, list[dist.ProcessGroup]] = field(default_factory=dict)
    stash: list[list[tuple[_Key, Any]]] = field(default_factory=list)  # a stack: modules may be re-entered

    def view(self, key: _Key, param: torch.Tensor) -> torch.Tensor:
        out = param
        if key in self.local and isinstance(out, DTensor):
            out = out.to_local()
        for group in self.grad_groups.get(key, ()):
            out = sum_gradient(out, group)
        return out

    def swap_in(self) -> None:
        keys = dict.fromkeys([*self.local, *self.grad_groups])  # registration order (module docstring)
        originals = [(key, self.owners[key[0]]._parameters[key[1]]) for key in keys]
        self.stash.append(originals)
        for key, param in originals:
            assert param is not None
            self.owners[key[0]]._parameters[key[1]] = self.view(key, param)  # type: ignore[assignment]

    def swap_back(self) -> None:
        if self.stash:
            for (owner, name), param in self.stash.pop():
                self.owners[owner]._parameters[name] = param


def _views(trigger: nn.Module) -> _Views:
    existing: _Views | None = trigger.__dict__.get(_ATTR)
    if existing is not None:
        return existing
    views = _Views()
    trigger.__dict__[_ATTR] = views
    trigger.register_forward_pre_hook(lambda _m, _a: views.swap_in())
    trigger.register_forward_hook(lambda _m, _a, _o: views.swap_back(), always_call=True)
    return views


def _key(views: _Views, owner: nn.Module, name: str) -> _Key:
    views.owners[id(owner)] = owner
    return (id(owner), name)


def forward_triggers(root: nn.Module) -> dict[int, list[nn.Module]]:
    """For every module under `root`, the modules whose forward reads its direct parameters: itself, or
    for a parameter container every module holding it as a child (several when it is tied)."""
    triggers: dict[int, list[nn.Module]] = {}
    for parent in root.modules():
        triggers.setdefault(id(parent), [parent])
        for child in parent.children():
            if isinstance(child, nn.ParameterDict | nn.ParameterList):
                found = triggers.setdefault(id(child), [])
                if parent not in found:
                    found.append(parent)
    return triggers


def _check(module: nn.Module, names: set[str]) -> None:
    for name in names:
        if module._parameters.get(name) is None:
            raise KeyError(f"{type(module).__name__} has no direct parameter {name!r}")


def compute_with_local_parameters(
    module: nn.Module, names: set[str], *, triggers: list[nn.Module] | None = None
) -> None:
    """From now on the forward of `module` (or of each of `triggers`, the modules reading a parameter
    container) sees the direct DTensor parameters `names` of `module` as local tensors."""
    _check(module, names)
    for name in names:
        if not isinstance(module._parameters[name], DTensor):
            raise TypeError(f"{type(module).__name__}.{name} is not a DTensor parameter")
    for trigger in triggers if triggers is not None else [module]:
        views = _views(trigger)
        views.local.update(dict.fromkeys(_key(views, module, name) for name in sorted(names)))


def sum_gradients_over(
    module: nn.Module, names: set[str], group: dist.ProcessGroup, *, trigger: nn.Module | None = None
) -> None:
    """From now on the gradients of the direct parameters `names` of `module` are summed over `group`.

    `trigger` (default `module`) is the module whose forward swaps the views in, e.g. the decoder block
    holding `module`: a compiled block (d9d.parallel.compile) runs its own hooks eagerly but traces those of
    its submodules, and a submodule's hook closes over per-layer state (the module's id in the view key),
    which dynamo guards on, so every block would compile its own graph (and past dynamo's recompile limit
    the remaining blocks run eagerly, with DTensor dispatch under tensor parallelism)."""
    _check(module, names)
    if dist.get_world_size(group) == 1:
        return
    views = _views(trigger if trigger is not None else module)
    for name in sorted(names):
        views.grad_groups.setdefault(_key(views, module, name), []).append(group)
