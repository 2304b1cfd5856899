"""LoRA on grouped experts: every expert gets its own rank-`r` update of the targeted projections."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from d9d.modules.moe import GroupedExperts
from d9d.peft.adapter import restore_original
from d9d.peft.lora.linear import fold, lora_dropout

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class LoRAGroupedExperts(GroupedExperts):
    """`GroupedExperts` whose projections `p` in `projections` compute
    `x @ W_e + (alpha / r) · dropout(x) @ A_e @ B_e` per expert e, with `p_lora_A` [E, in, r] and
    `p_lora_B` [E, r, out] (the `[E, in, out]` layout of the expert weights), run through the same
    grouped-matmul backend. The factors are direct parameters with a leading expert dim, so expert
    parallelism shards them exactly like the weights; the base parameter names are unchanged."""

    _replaced: GroupedExperts  # outside the module tree (no keys): what `base_module` / merging give back

    def __init__(
        self,
        base: GroupedExperts,
        projections: Sequence[str],
        rank: int,
        alpha: float,
        dropout: float = 0.0,
    ) -> None:
        unknown = sorted(set(projections) - set(EXPERT_PROJECTIONS))
        if unknown or not projections:
            raise ValueError(
                f"expert projections must be a non-empty subset of {EXPERT_PROJECTIONS}, got {projections}"
            )
        experts, hidden, intermediate = base.gate_proj.shape
        with torch.device("meta"):  # the base tensors are adopted below; allocate nothing here
            super().__init__(
                experts,
                hidden,
                intermediate,
                grouped_mm=base.grouped_mm,
                init_std=base.init_std,
                output_init_std=base.output_init_std,
            )
        for name in EXPERT_PROJECTIONS:
            setattr(self, name, getattr(base, name))
        self.projections = tuple(p for p in EXPERT_PROJECTIONS if p in projections)
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank
        self.lora_dropout = lora_dropout(dropout)
        for name in self.projections:
            weight: torch.Tensor = getattr(base, name)
            n, d_in, d_out = weight.shape
            for factor, shape in (("A", (n, d_in, rank)), ("B", (n, rank, d_out))):
                tensor = torch.empty(shape, device=weight.device, dtype=weight.dtype)
                self.register_parameter(f"{name}_lora_{factor}", nn.Parameter(tensor))
        self.train(base.training)
        self.__dict__["_replaced"] = base  # plain attribute: nn.Module would register it as a child
        self.reset_adapter()

    def adapter_parameter_names(self) -> tuple[str, ...]:
        return tuple(f"{p}_lora_{f}" for p in self.projections for f in "AB")

    def _factors(self, projection: str) -> tuple[torch.Tensor, torch.Tensor]:
        a: torch.Tensor = getattr(self, f"{projection}_lora_A")
        b: torch.Tensor = getattr(self, f"{projection}_lora_B")
        return a, b

    def reset_adapter(self) -> None:
        for name in self.projections:
            a, b = self._factors(name)
            bound = 1 / math.sqrt(a.shape[1])  # per expert, like the dense LoRA A (fan-in = in)
            nn.init.uniform_(a, -bound, bound)
            nn.init.zeros_(b)

    def delta_weight(self, projection: str) -> torch.Tensor:
        """The update of one projection in the expert weights' layout, [E, in, out]."""
        a, b = self._factors(projection)
        return self.scale * torch.bmm(a, b)

    def _project(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = self.grouped_mm(x, getattr(self, name), counts)
        if name not in self.projections:
            return out
        a, b = self._factors(name)
        update = self.grouped_mm(self.grouped_mm(self.lora_dropout(x), a, counts), b, counts)
        return out + self.scale * update

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        gate = self._project("gate_proj", x, tokens_per_expert)
        up = self._project("up_proj", x, tokens_per_expert)
        return self._project("down_proj", F.silu(gate) * up, tokens_per_expert)

    def base_module(self) -> nn.Module:
        return restore_original(self._replaced, self)

    def merged_module(self) -> nn.Module:
        folded = {p: fold(getattr(self, p), self.delta_weight(p)) for p in self.projections}
        return restore_original(self._replaced, self, folded)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora={list(self.projections)}, rank={self.rank}, alpha={self.alpha}"
