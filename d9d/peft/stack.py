"""Method stacking: apply several methods in order and train the union of what they train."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from d9d.peft.method import InjectionResult, PeftMethod


class Stack:
    def __init__(self, methods: Sequence[PeftMethod]) -> None:
        if not methods:
            raise ValueError("a PEFT stack needs at least one method")
        self.methods = tuple(methods)

    def inject(self, model: nn.Module) -> InjectionResult:
        result = InjectionResult(trainable=frozenset())
        for method in self.methods:
            result = result | method.inject(model)
        return result
