"""Method stacking: apply several methods in order and train the union of what they train."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from d9d.peft.method import InjectionResult, PeftMethod, raise_unmatched


class Stack:
    def __init__(self, methods: Sequence[PeftMethod]) -> None:
        if not methods:
            raise ValueError("a PEFT stack needs at least one method")
        self.methods = tuple(methods)

    def inject(self, model: nn.Module, *, require_match: bool = True) -> InjectionResult:
        """Every method in order; with `require_match`, the patterns that matched nothing are raised after
        all of them ran, together, each named by its index (`methods.<i>.target_modules`)."""
        result = InjectionResult(trainable=frozenset())
        for i, method in enumerate(self.methods):
            result = result | method.inject(model, require_match=False).under(f"methods.{i}")
        if require_match:
            raise_unmatched(result)
        return result
