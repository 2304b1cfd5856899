"""LoRA on grouped experts: every expert gets its own rank-`r` update of the targeted projections."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from d9d.modules.moe import GroupedExperts
from d9d.peft.adapter import init_uniform_, restore_original
from d9d.peft.lora.linear import fold, lora_dropout

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class LoRAGroupedExperts(GroupedExperts):
    """`GroupedExperts` whose projections `p` in `projections` compute
    `x @ W_e + (alpha / r) · dropout(x) @ A_e @ B_e` per expert e, with `p_lora_A` [E, in, r] and
    `p_lora_B` [E, r, out] (the `[E, in, out]` layout of the expert weights), run through the same
    grouped-matmul backend. The factors are direct parameters with a leading expert dim, so expert
    parallelism shards them exactly like the weights; the base parameter names are unchanged.

    Gate and up are addressed by their own names although the base stores them fused in `gate_up_proj`
    (gate in the first `intermediate` output columns, up in the last): each keeps its own factors, and its
    update is added to (and folded into) its half of the fused projection only."""

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
        experts, intermediate, hidden = base.down_proj.shape
        with torch.device("meta"):  # the base tensors are adopted below; allocate nothing here
            super().__init__(
                experts,
                hidden,
                intermediate,
                grouped_mm=base.grouped_mm,
                init_std=base.init_std,
                output_init_std=base.output_init_std,
            )
        self.gate_up_proj = base.gate_up_proj
        self.down_proj = base.down_proj
        self.projections = tuple(p for p in EXPERT_PROJECTIONS if p in projections)
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank
        self.lora_dropout = lora_dropout(dropout)
        shapes = {
            "gate_proj": (hidden, intermediate),
            "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden),
        }
        device, dtype = base.down_proj.device, base.down_proj.dtype
        for name in self.projections:
            d_in, d_out = shapes[name]
            for factor, shape in (("A", (experts, d_in, rank)), ("B", (experts, rank, d_out))):
                tensor = torch.empty(shape, device=device, dtype=dtype)
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

    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        for name in self.projections:
            a, b = self._factors(name)
            init_uniform_(a, 1 / math.sqrt(a.shape[1]), generator)  # per expert, like the dense LoRA A
            nn.init.zeros_(b)

    def delta_weight(self, projection: str) -> torch.Tensor:
        """The update of one projection in the expert weights' layout, [E, in, out]."""
        a, b = self._factors(projection)
        return self.scale * torch.bmm(a, b)

    def _update(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Projection `name`'s low-rank update of `x`, scaled."""
        a, b = self._factors(name)
        return self.scale * self.grouped_mm(self.grouped_mm(self.lora_dropout(x), a, counts), b, counts)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = tokens_per_expert
        gate_up = self.grouped_mm(x, self.gate_up_proj, counts)
        half = gate_up.shape[-1] // 2
        for offset, name in ((0, "gate_proj"), (half, "up_proj")):
            if name in self.projections:
                # In place into its half: no zeros for an untargeted half, no copy of the fused output, and
                # gate / up keep the base module's layout (bit-equal to it while B is zero). Safe for
                # autograd: a grouped matmul's backward needs its inputs, not its output.
                gate_up.narrow(-1, offset, half).add_(self._update(name, x, counts))
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        out = self.grouped_mm(hidden, self.down_proj, counts)
        if "down_proj" in self.projections:
            out = out + self._update("down_proj", hidden, counts)
        return out

    def base_module(self) -> nn.Module:
        return restore_original(self._replaced, self)

    def merged_module(self) -> nn.Module:
        folded: dict[str, nn.Parameter] = {}
        halves = [p for p in ("gate_proj", "up_proj") if p in self.projections]
        if halves:
            # the untargeted half gets a zero update: folding is a one-off, and one `fold` keeps its rounding
            deltas = {p: self.delta_weight(p) for p in halves}
            zero = torch.zeros_like(next(iter(deltas.values())))
            delta = torch.cat([deltas.get("gate_proj", zero), deltas.get("up_proj", zero)], dim=-1)
            folded["gate_up_proj"] = fold(self.gate_up_proj, delta)
        if "down_proj" in self.projections:
            folded["down_proj"] = fold(self.down_proj, self.delta_weight("down_proj"))
        return restore_original(self._replaced, self, folded)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora={list(self.projections)}, rank={self.rank}, alpha={self.alpha}"
