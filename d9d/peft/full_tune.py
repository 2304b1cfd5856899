"""Full tuning: train the existing parameters of the modules matching a pattern, add nothing."""

from __future__ import annotations

import re

from torch import nn

from d9d.peft.config import FullTuneConfig
from d9d.peft.method import InjectionResult


class FullTune:
    def __init__(self, config: FullTuneConfig) -> None:
        self.config = config

    def inject(self, model: nn.Module) -> InjectionResult:
        pattern = re.compile(self.config.target_modules)
        matched = [(name, m) for name, m in model.named_modules() if pattern.fullmatch(name)]
        names = frozenset(
            full
            for name, module in matched
            for full, _ in module.named_parameters(prefix=name, remove_duplicate=False)
        )
        if not names:
            what = "no module" if not matched else f"only modules without parameters ({matched[0][0]}, ...)"
            raise ValueError(f"full_tune target_modules {self.config.target_modules!r} fully matches {what}")
        return InjectionResult(trainable=names)
