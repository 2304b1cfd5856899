"""Export LoRA adapters in the Hugging Face `peft` layout: `adapter_config.json` +
`adapter_model.safetensors`, keys `base_model.model.<HF module>.lora_A.weight` / `lora_B.weight`.

d9d module names become Hugging Face ones through the model's own d9d→HF state mapper (the one used to
export merged weights), so the adapter can never disagree with the exported base model. Full-tuned
parameters go along as `modules_to_save`. Only pieces with a 1:1 key in the HF checkpoint can be
expressed this way: LoRA on grouped experts, or a trained split/tied vocabulary, is refused by name.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.core.context import DistributedContext
from d9d.core.dist_ops import gather_object
from d9d.core.files import atomic_write_bytes, atomic_write_text
from d9d.peft.adapter import adapted_modules
from d9d.peft.lora.linear import LoRALinear
from d9d.state.mapper import StateGroup, StateMapper, apply_group

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass
class _Adapter:
    """An adapter's content: tensors by peft key, LoRA hyper-parameters by HF module."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    lora: dict[str, tuple[int, float, float]] = field(
        default_factory=dict
    )  # module -> (rank, alpha, dropout)
    modules_to_save: set[str] = field(default_factory=set)

    def update(self, other: _Adapter) -> None:
        self.tensors |= other.tensors
        self.lora |= other.lora
        self.modules_to_save |= other.modules_to_save


@dataclass
class _Plan:
    """Where each exported tensor comes from (peft key -> d9d parameter name); needs no tensor data."""

    sources: dict[str, str] = field(default_factory=dict)
    lora: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    modules_to_save: set[str] = field(default_factory=set)


class _HFNames:
    """d9d state key → HF key, only where the mapper moves the tensor unchanged (a rename)."""

    def __init__(self, mapper: StateMapper) -> None:
        self.mapper = mapper
        self.by_input: dict[str, StateGroup] = {k: g for g in mapper.groups() for k in g.inputs}

    def key(self, d9d_key: str, what: str) -> str:
        group = self.by_input.get(d9d_key)
        if group is not None and len(group.inputs) == 1 and len(group.outputs) == 1:
            probe = torch.empty(0, device="meta")
            ((hf_key, value),) = apply_group(self.mapper, group, {d9d_key: probe}).items()
            if value is probe:
                return hf_key
        raise ValueError(
            f"{what} {d9d_key!r} has no 1:1 key in the Hugging Face checkpoint (mapper group: {group}); "
            "the peft adapter layout cannot express it, export merged weights instead"
        )


def _plan(module: nn.Module, names: _HFNames) -> _Plan:
    plan = _Plan()
    adapter_params: set[str] = set()
    for name, m in adapted_modules(module):
        adapter_params |= {f"{name}.{p}" for p in m.adapter_parameter_names()}
        if not isinstance(m, LoRALinear):
            raise ValueError(
                f"{name} is a {type(m).__name__}: the peft adapter layout covers LoRA on dense nn.Linear "
                "layers only; export merged weights instead"
            )
        if m.weight.requires_grad:
            raise ValueError(f"{name} is both LoRA-adapted and full-tuned; peft cannot express that")
        hf_module = names.key(f"{name}.weight", "LoRA target").removesuffix(".weight")
        dropout = m.lora_dropout.p if isinstance(m.lora_dropout, nn.Dropout) else 0.0
        plan.lora[hf_module] = (m.rank, m.alpha, dropout)
        plan.sources[f"{PEFT_PREFIX}{hf_module}.lora_A.weight"] = f"{name}.lora_A"
        plan.sources[f"{PEFT_PREFIX}{hf_module}.lora_B.weight"] = f"{name}.lora_B"
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.requires_grad and name not in adapter_params:
            hf_key = names.key(name, "full-tuned parameter")
            plan.modules_to_save.add(hf_key.rpartition(".")[0])
            plan.sources[f"{PEFT_PREFIX}{hf_key}"] = name
    return plan


def check_peft_exportable(module: nn.Module, d9d_to_hf: StateMapper) -> None:
    """Raise the error `save_peft_adapter` would raise for `module`, without touching data (works on meta),
    so a job fails before training rather than at export."""
    _plan(module, _HFNames(d9d_to_hf))


def _full(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return full.detach().to("cpu").contiguous()


def _collect(module: nn.Module, names: _HFNames) -> _Adapter:
    plan = _plan(module, names)
    params = dict(module.named_parameters(remove_duplicate=False))
    tensors = {key: _full(params[name]) for key, name in plan.sources.items()}
    return _Adapter(tensors, plan.lora, plan.modules_to_save)


def _config(adapter: _Adapter, base_model_name_or_path: str | None) -> dict[str, Any]:
    (rank, alpha), _ = Counter((r, a) for r, a, _ in adapter.lora.values()).most_common(1)[0]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        # peft has one dropout per adapter; it only matters for further training
        "lora_dropout": max(d for _, _, d in adapter.lora.values()),
        "target_modules": sorted(adapter.lora),
        # modules with another rank/alpha than the most common one, by exact (escaped) name
        "rank_pattern": {re.escape(m): r for m, (r, _, _) in sorted(adapter.lora.items()) if r != rank},
        "alpha_pattern": {re.escape(m): a for m, (_, a, _) in sorted(adapter.lora.items()) if a != alpha},
        "modules_to_save": sorted(adapter.modules_to_save) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }


def save_peft_adapter(
    modules: nn.Module | Sequence[nn.Module],
    path: str | Path,
    d9d_to_hf: StateMapper,
    *,
    ctx: DistributedContext | None = None,
    base_model_name_or_path: str | None = None,
    extra_files: Mapping[str, bytes] | None = None,
) -> Path:
    """Write the LoRA adapters (and full-tuned parameters) of `modules` as a `peft` adapter directory that
    `peft.PeftModel.from_pretrained(hf_model, path)` loads. `d9d_to_hf` is the model's d9d→HF mapper
    (e.g. `d9d.models.hf.d9d_to_hf_mapper(config)`). With a distributed `ctx` every rank calls this with
    its own stages; the pieces are gathered and rank 0 writes.

    `base_model_name_or_path` goes into `adapter_config.json`: `peft.AutoPeftModelForCausalLM` loads the
    base model from it (a hub name or a local directory). `extra_files` (by file name: tokenizer files,
    `generation_config.json`) are written beside the adapter."""
    names = _HFNames(d9d_to_hf)
    adapter = _Adapter()
    for module in [modules] if isinstance(modules, nn.Module) else modules:
        adapter.update(_collect(module, names))
    dest = Path(path)
    if ctx is not None and ctx.is_distributed:
        pieces = gather_object(adapter, dst=0)
        if pieces is None:
            return dest
        adapter = _Adapter()
        for piece in pieces:
            adapter.update(piece)
    if not adapter.lora:
        raise ValueError("the model has no LoRA adapter on a dense layer: nothing to write as a peft adapter")
    dest.mkdir(parents=True, exist_ok=True)
    for name, data in (extra_files or {}).items():
        if Path(name).name != name or name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            raise ValueError(f"extra_files: {name!r} must be a plain file name other than the adapter's own")
        atomic_write_bytes(dest / name, data)
    weights = dest / ADAPTER_WEIGHTS
    tmp = weights.with_name(f".{weights.name}.tmp")
    save_file(adapter.tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(weights)
    # Written last: a directory with an adapter_config.json is a complete adapter.
    config = _config(adapter, base_model_name_or_path)
    atomic_write_text(dest / ADAPTER_CONFIG, json.dumps(config, indent=2) + "\n")
    return dest
