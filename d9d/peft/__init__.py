"""Parameter-efficient fine-tuning: LoRA (dense and grouped experts), full-tune, stacking; merging and
Hugging Face `peft` adapter export. See docs/peft.md."""

from d9d.peft.adapter import AdaptedModule, adapted_modules, base_view, merge, merged, reset_adapters
from d9d.peft.build import build_peft_method
from d9d.peft.config import FullTuneConfig, LoRAConfig, PeftConfig, StackConfig
from d9d.peft.full_tune import FullTune
from d9d.peft.hf_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_peft_exportable, save_peft_adapter
from d9d.peft.lora import EXPERT_PROJECTIONS, LoRA, LoRAGroupedExperts, LoRALinear
from d9d.peft.method import (
    InjectionResult,
    PeftMethod,
    UnmatchedTarget,
    check_targets_match,
    inject_and_freeze,
    raise_unmatched,
)
from d9d.peft.stack import Stack
from d9d.peft.trainable_state import frozen_parameter_names, trainable_state_dict

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "EXPERT_PROJECTIONS",
    "AdaptedModule",
    "FullTune",
    "FullTuneConfig",
    "InjectionResult",
    "LoRA",
    "LoRAConfig",
    "LoRAGroupedExperts",
    "LoRALinear",
    "PeftConfig",
    "PeftMethod",
    "Stack",
    "StackConfig",
    "UnmatchedTarget",
    "adapted_modules",
    "base_view",
    "build_peft_method",
    "check_peft_exportable",
    "check_targets_match",
    "frozen_parameter_names",
    "inject_and_freeze",
    "merge",
    "merged",
    "raise_unmatched",
    "reset_adapters",
    "save_peft_adapter",
    "trainable_state_dict",
]
