"""LoRA: low-rank updates of dense projections and of grouped experts."""

from d9d.peft.lora.experts import EXPERT_PROJECTIONS, LoRAGroupedExperts
from d9d.peft.lora.linear import LoRALinear
from d9d.peft.lora.method import LoRA

__all__ = ["EXPERT_PROJECTIONS", "LoRA", "LoRAGroupedExperts", "LoRALinear"]
