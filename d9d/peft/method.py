"""The PEFT method contract and `inject_and_freeze`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn


@dataclass(frozen=True)
class InjectionResult:
    """What a method did to a model.

    `trainable`: names of the parameters to train. `added`: state keys the method introduced, which base
    checkpoints do not have. Base keys never change (adapted modules keep the names of the modules they
    replace), so no state-mapper renames exist: a base checkpoint loads into the adapted model through
    `d9d.peft.base_view` with the base model's own mapper. Names, not tensors, because parallelization
    replaces parameter objects after injection; `parameters(model)` looks them up.
    """

    trainable: frozenset[str]
    added: frozenset[str] = frozenset()

    def __or__(self, other: InjectionResult) -> InjectionResult:
        return InjectionResult(self.trainable | other.trainable, self.added | other.added)

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        params = dict(model.named_parameters(remove_duplicate=False))
        missing = sorted(self.trainable - params.keys())
        if missing:
            raise KeyError(
                f"the model has no parameter(s) {missing[:5]}: it is not the model that was injected"
            )
        unique = {id(params[name]): params[name] for name in sorted(self.trainable)}  # tied aliases once
        return list(unique.values())


class PeftMethod(Protocol):
    def inject(self, model: nn.Module) -> InjectionResult:
        """Modify `model` in place (on meta or materialized) and report what to train. Raises a
        `ValueError` naming the pattern when it matches nothing."""
        ...


def inject_and_freeze(model: nn.Module, method: PeftMethod) -> InjectionResult:
    """Freeze every parameter of `model`, inject `method`, and unfreeze exactly what it trains."""
    for param in model.parameters():
        param.requires_grad_(False)
    result = method.inject(model)
    for param in result.parameters(model):
        param.requires_grad_(True)
    return result
