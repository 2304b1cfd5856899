"""Adapted modules and the model-wide operations on them: base view, merge, adapter (re)initialization.

An adapted module replaces a module of the model (an `nn.Linear`, the grouped experts) and keeps the
replaced module's parameter names (`weight`, `gate_up_proj`, ...) next to its adapter parameters, so a base
checkpoint's keys stay valid for the adapted model: no state-mapper renames are ever needed. What
differs from the base model is only *extra* keys, which `base_view` hides while a base checkpoint loads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from d9d.determinism.dtensor_rng import copy_full_
from d9d.determinism.seeds import mix_seed


@runtime_checkable
class AdaptedModule(Protocol):
    """A module standing in for a base module, with trainable adapter parameters of its own."""

    def adapter_parameter_names(self) -> tuple[str, ...]:
        """Names of this module's direct parameters that the adapter added (absent from base checkpoints)."""
        ...

    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """(Re)initialize the adapter so that the module computes exactly what the base module computes;
        random parts drawn from `generator` (a CPU one, `init_uniform_`), else from the global RNG."""
        ...

    def base_module(self) -> nn.Module:
        """The replaced module, holding this module's current base parameters (shared, not copied)."""
        ...

    def merged_module(self) -> nn.Module:
        """The replaced module holding new base parameters with the adapter folded in; this module's own
        parameters are left untouched."""
        ...


def adapted_modules(model: nn.Module) -> list[tuple[str, AdaptedModule]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, AdaptedModule)]


def _direct_tensor_names(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters(recurse=False)] + [
        n for n, _ in module.named_buffers(recurse=False)
    ]


def _point(
    dst: nn.Module, src: nn.Module, names: list[str], replacements: Mapping[str, nn.Parameter]
) -> None:
    for name in names:
        setattr(dst, name, replacements.get(name, getattr(src, name)))


def restore_original(
    original: nn.Module, current: nn.Module, replacements: Mapping[str, nn.Parameter] | None = None
) -> nn.Module:
    """Point `original`'s direct parameters and buffers at `current`'s (or at `replacements`) and return
    it. The adapted module's tensors may have been replaced since injection (materialization, DTensor
    conversion), so the replaced module is brought up to date before it is put back."""
    _point(original, current, _direct_tensor_names(original), replacements or {})
    original.train(current.training)
    return original


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    if not name:
        raise ValueError("the root module cannot be replaced by an adapter; adapt one of its children")
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)


def reset_adapters(model: nn.Module, seed: int | None = None) -> None:
    """Initialize every adapter (e.g. after `to_empty`, once the base weights are in place). With `seed`,
    each adapted module draws from its own generator seeded by `seed` and the module's name, so adapters
    start the same whatever the layout: a pipeline stage holding some of the layers, replicas, FSDP or
    expert shards (without, from the global RNG, in module order: a stage's draws depend on what it holds)."""
    with torch.no_grad():
        for name, module in adapted_modules(model):
            if seed is None:
                module.reset_adapter()
            else:
                module.reset_adapter(torch.Generator().manual_seed(mix_seed(seed, "adapter", name)))


def init_uniform_(param: torch.Tensor, bound: float, generator: torch.Generator | None) -> None:
    """`param` ~ U(-bound, bound). With a (CPU) `generator` the whole tensor is drawn on the host and this
    rank keeps its part of a DTensor: the values do not depend on the device or on how `param` is sharded."""
    if generator is None:
        nn.init.uniform_(param, -bound, bound)
        return
    full = torch.empty(param.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
    copy_full_(param, full)


@contextmanager
def _swapped(
    model: nn.Module, build: Callable[[AdaptedModule], nn.Module], sync_back: bool
) -> Iterator[None]:
    swapped: list[tuple[str, AdaptedModule, nn.Module]] = []
    try:
        for name, module in adapted_modules(model):
            view = build(module)
            replace_module(model, name, view)
            swapped.append((name, module, view))
        yield
    finally:
        for name, module, view in swapped:
            if sync_back:  # base code may have replaced the view's tensors instead of filling them
                _point(module, view, _direct_tensor_names(view), {})  # type: ignore[arg-type]
            replace_module(model, name, module)  # type: ignore[arg-type]


@contextmanager
def base_view(model: nn.Module) -> Iterator[None]:
    """Temporarily put the base modules back, sharing the adapted modules' base parameters: the model has
    exactly the base model's structure and keys, so base code (initialization, strict checkpoint loading)
    runs unchanged and fills the shared parameters. Adapters are untouched."""
    with _swapped(model, lambda m: m.base_module(), sync_back=True):
        yield


@contextmanager
def merged(model: nn.Module) -> Iterator[None]:
    """Temporarily replace every adapted module by its base module with the adapter folded in (new
    tensors): the model has the base structure and keys, and computes what the adapted model computes.
    For exporting merged weights without giving up the adapters."""
    with _swapped(model, _merged_module, sync_back=False):
        yield


def merge(model: nn.Module) -> None:
    """Fold every adapter into its base weights for good and restore the base modules and keys."""
    for name, module in adapted_modules(model):
        replace_module(model, name, _merged_module(module))


def _merged_module(module: AdaptedModule) -> nn.Module:
    with torch.no_grad():
        return module.merged_module()
