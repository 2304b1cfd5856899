"""Resolve a PEFT config (the discriminated union) into a method."""

from __future__ import annotations

from d9d.peft.config import FullTuneConfig, LoRAConfig, PeftConfig, StackConfig
from d9d.peft.full_tune import FullTune
from d9d.peft.lora import LoRA
from d9d.peft.method import PeftMethod
from d9d.peft.stack import Stack


def build_peft_method(config: PeftConfig) -> PeftMethod:
    if isinstance(config, LoRAConfig):
        return LoRA(config)
    if isinstance(config, FullTuneConfig):
        return FullTune(config)
    if isinstance(config, StackConfig):
        return Stack([build_peft_method(m) for m in config.methods])
    raise TypeError(f"unknown PEFT config {type(config).__name__}")
