"""The LoRA method: find targets by name, replace them with adapted modules."""

from __future__ import annotations

import re

from torch import nn

from d9d.modules.moe import GroupedExperts
from d9d.peft.adapter import AdaptedModule, replace_module
from d9d.peft.config import LoRAConfig
from d9d.peft.lora.experts import EXPERT_PROJECTIONS, LoRAGroupedExperts
from d9d.peft.lora.linear import LoRALinear
from d9d.peft.method import InjectionResult, UnmatchedTarget, raise_unmatched


class LoRA:
    def __init__(self, config: LoRAConfig) -> None:
        self.config = config

    def inject(self, model: nn.Module, *, require_match: bool = True) -> InjectionResult:
        c = self.config
        pattern = re.compile(c.target_modules)
        linears: list[tuple[str, nn.Linear]] = []
        experts: list[tuple[str, GroupedExperts, list[str]]] = []
        candidates: list[str] = []
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name:
                candidates.append(name)
                if pattern.fullmatch(name):
                    linears.append((name, module))
            elif isinstance(module, GroupedExperts):
                names = [f"{name}.{p}" if name else p for p in EXPERT_PROJECTIONS]
                candidates += names
                hits = [
                    p for p, full in zip(EXPERT_PROJECTIONS, names, strict=True) if pattern.fullmatch(full)
                ]
                if hits:
                    experts.append((name, module, hits))
        if not linears and not experts:
            needs = "nn.Linear module or grouped-expert projection"
            target = UnmatchedTarget("target_modules", "lora", c.target_modules, needs, tuple(candidates))
            result = InjectionResult(trainable=frozenset(), unmatched=frozenset({target}))
            if require_match:
                raise_unmatched(result)
            return result
        adapted: list[tuple[str, AdaptedModule]] = []
        for name, linear in linears:
            _refuse_twice(name, linear)
            module = LoRALinear(linear, c.rank, c.alpha, c.dropout)
            replace_module(model, name, module)
            adapted.append((name, module))
        for name, grouped, hits in experts:
            _refuse_twice(name, grouped)
            lora = LoRAGroupedExperts(grouped, hits, c.rank, c.alpha, c.dropout)
            replace_module(model, name, lora)
            adapted.append((name, lora))
        keys = frozenset(
            f"{name}.{p}" if name else p for name, m in adapted for p in m.adapter_parameter_names()
        )
        return InjectionResult(trainable=keys, added=keys)


def _refuse_twice(name: str, module: nn.Module) -> None:
    if isinstance(module, AdaptedModule):
        raise ValueError(f"{name} already carries an adapter; two LoRA methods cannot target the same module")
