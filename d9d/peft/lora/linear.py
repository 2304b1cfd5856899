"""LoRA on a dense projection: `y = W x + b + (alpha / r) · B A dropout(x)`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from d9d.peft.adapter import init_uniform_, restore_original


def lora_dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


def fold(weight: torch.Tensor, delta: torch.Tensor) -> nn.Parameter:
    """`weight + delta` as a new parameter, summed in at least float32 so low-precision weights round once."""
    wide = torch.promote_types(weight.dtype, torch.float32)
    merged = (weight.detach().to(wide) + delta.to(wide)).to(weight.dtype)
    return nn.Parameter(merged, requires_grad=weight.requires_grad)


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a rank-`r` update. It keeps the base layer's `weight` / `bias` (same names, same
    tensors) and adds `lora_A` [r, in] and `lora_B` [out, r] (the Hugging Face `peft` shapes), so base
    checkpoints load by their own keys and code that reads `.weight` keeps working. Built from the layer
    it replaces, on whatever device that layer is (meta included)."""

    _replaced: nn.Linear  # outside the module tree (no keys): what `base_module` / merging give back

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        with torch.device("meta"):  # the base layer's tensors are adopted below; allocate nothing here
            super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight = base.weight
        self.bias = base.bias
        self.rank = rank
        self.alpha = alpha
        self.scale = alpha / rank
        self.lora_dropout = lora_dropout(dropout)
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(base.out_features, rank, device=device, dtype=dtype))
        self.train(base.training)
        self.__dict__["_replaced"] = base  # plain attribute: nn.Module would register it as a child
        self.reset_adapter()

    def adapter_parameter_names(self) -> tuple[str, ...]:
        return ("lora_A", "lora_B")

    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        # A like a fresh nn.Linear (the `peft` default), B zero: the update starts at exactly zero.
        init_uniform_(self.lora_A, 1 / math.sqrt(self.in_features), generator)
        nn.init.zeros_(self.lora_B)

    def delta_weight(self) -> torch.Tensor:
        """The update in the base weight's layout, [out, in]."""
        return self.scale * (self.lora_B @ self.lora_A)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return base + self.scale * update

    def base_module(self) -> nn.Module:
        return restore_original(self._replaced, self)

    def merged_module(self) -> nn.Module:
        return restore_original(self._replaced, self, {"weight": fold(self.weight, self.delta_weight())})

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"
