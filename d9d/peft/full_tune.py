"""Full tuning: train the existing parameters of the modules matching a pattern, add nothing."""

from __future__ import annotations

import re

from torch import nn

from d9d.peft.config import FullTuneConfig
from d9d.peft.method import InjectionResult, UnmatchedTarget, raise_unmatched


class FullTune:
    def __init__(self, config: FullTuneConfig) -> None:
        self.config = config

    def inject(self, model: nn.Module, *, require_match: bool = True) -> InjectionResult:
        pattern = re.compile(self.config.target_modules)
        matched = [(name, m) for name, m in model.named_modules() if pattern.fullmatch(name)]
        names = frozenset(
            full
            for name, module in matched
            for full, _ in module.named_parameters(prefix=name, remove_duplicate=False)
        )
        if names:
            return InjectionResult(trainable=names)
        # candidates: the modules that hold parameters of their own
        owners = tuple(
            n for n, m in model.named_modules() if n and next(m.parameters(recurse=False), None) is not None
        )
        target = UnmatchedTarget(
            "target_modules", "full_tune", self.config.target_modules, "module with parameters", owners
        )
        result = InjectionResult(trainable=frozenset(), unmatched=frozenset({target}))
        if require_match:
            raise_unmatched(result)
        return result
