"""`from_pretrained` / `save_pretrained`: Hugging Face directories ⇄ d9d causal LMs, for every registered
family with a Hugging Face format (the `model_type` of `config.json` picks it)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel
from torch import nn

from d9d.models.family import family_of
from d9d.models.hf.config import config_from_hf, config_to_hf
from d9d.models.hf.mapping import (
    ExpertLayout,
    d9d_to_hf_mapper,
    detect_expert_layout,
    expected_hf_shapes,
    expert_bias_hf_keys,
    hf_to_d9d_mapper_for,
)
from d9d.pipeline.api import PipelineStageInfo
from d9d.state import (
    CheckpointFormatError,
    load_model_state,
    read_header,
    resolve_checkpoint,
    save_model_state,
)

CONFIG_NAME = "config.json"
# Files of a Hugging Face model directory that describe how to use the weights rather than the weights
# themselves; an export of a model that started from such a directory carries them along.
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# keys older checkpoints carry that d9d recomputes instead of storing
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def side_files(source: Path | None) -> dict[str, bytes]:
    """The tokenizer and generation-config files `source` (a Hugging Face model directory) has, by name."""
    if source is None:
        return {}
    return {name: (source / name).read_bytes() for name in SIDE_FILES if (source / name).is_file()}


def build_causal_lm(config: BaseModel, stage: PipelineStageInfo | None = None) -> Any:
    """The causal-LM model of `config`'s family, for `stage` (default: the whole model)."""
    return family_of(config).build_causal_lm(config, stage)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _checkpoint_shapes(path: Path) -> tuple[dict[str, tuple[int, ...]], torch.dtype | None]:
    key_to_file, _ = resolve_checkpoint(path)
    shapes: dict[str, tuple[int, ...]] = {}
    dtype: torch.dtype | None = None
    for file in sorted(set(key_to_file.values())):
        for key, entry in read_header(file).entries.items():
            if key in key_to_file:
                shapes[key] = entry.shape
                if dtype is None and entry.dtype.is_floating_point:
                    dtype = entry.dtype
    return shapes, dtype


def check_checkpoint_matches(
    path: Path, config: BaseModel, found: Mapping[str, tuple[int, ...]], layout: ExpertLayout
) -> None:
    """Compare a checkpoint's keys and shapes with what `config` needs, before any tensor is read; every
    problem is listed with the key and both shapes."""
    with torch.device("meta"):
        full = build_causal_lm(config)
    expected = expected_hf_shapes(config, full.state_dict(), layout)
    tolerated = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    optional = set(expert_bias_hf_keys(config))  # e.g. an expert bias: absent, it starts at zero
    tolerated |= optional
    problems = [
        f"missing key {key!r} (expected shape {shape})"
        for key, shape in sorted(expected.items())
        if key not in found and key not in optional
    ]
    problems += [
        f"unexpected key {key!r} with shape {shape}"
        for key, shape in sorted(found.items())
        if key not in expected and key not in tolerated and not key.endswith(_IGNORED_SUFFIXES)
    ]
    problems += [
        f"key {key!r} has shape {shape} in the checkpoint but the model expects {expected[key]}"
        for key, shape in sorted(found.items())
        if key in expected and shape != expected[key]
    ]
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointFormatError(
            f"{path} does not match its config.json ({type(config).__name__}, expert layout {layout!r}):"
            f"\n  {shown}{more}"
        )


def from_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    stage: PipelineStageInfo | None = None,
    config_overrides: Mapping[str, Any] | None = None,
) -> Any:
    """Load a Hugging Face directory of a registered family (`config.json` + `model.safetensors` or a sharded
    index) as a d9d causal-LM model, for `stage` only (default: the whole model).

    `dtype` defaults to the checkpoint's; `device` to CPU. `config_overrides` set d9d-only config fields
    (attention/grouped-mm backends, vocabulary splits, expert bias, loss chunk size, ...). Per-expert
    (transformers v4 style) and fused (v5 style) expert tensors both load. The checkpoint is validated
    against the config before any tensor data is read; tensors then stream in file by file.
    """
    root = Path(path)
    config_file = root / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"{root}: no {CONFIG_NAME}")
    config = config_from_hf(json.loads(config_file.read_text()), **dict(config_overrides or {}))
    found, checkpoint_dtype = _checkpoint_shapes(root)
    layout = detect_expert_layout(found)
    check_checkpoint_matches(root, config, found, layout)

    with torch.device("meta"), _default_dtype(dtype or checkpoint_dtype or torch.float32):
        model = build_causal_lm(config, stage)
    model.to_empty(device=device or "cpu")
    with torch.no_grad():
        model.reset_parameters()  # d9d-only state (router buffers) starts from its initial values
    mapper = hf_to_d9d_mapper_for(config, found)
    load_model_state(root, model, mapper, strict=True, allow_cast=True, progress=False)
    return model


def save_pretrained(
    model: nn.Module,
    path: str | Path,
    *,
    expert_layout: ExpertLayout = "per_expert",
    overwrite: bool = False,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write `model` (a whole, non-distributed causal-LM model) as a Hugging Face directory that
    `transformers.AutoModelForCausalLM.from_pretrained` loads: `config.json` plus safetensors weights,
    experts one module each (the layout transformers itself writes) unless `expert_layout="fused"`.

    Distributed models (pipeline stages, DTensor parameters) are saved by every rank together through
    `d9d.state.save_model_state(path, module, d9d_to_hf_mapper(config), distributed=True)`.
    """
    stage: PipelineStageInfo = getattr(model, "stage", PipelineStageInfo())
    config = getattr(model, "config", None)
    if not isinstance(config, BaseModel):
        raise TypeError(f"{type(model).__name__} has no model-family config (`.config`)")
    if stage.num_stages != 1:
        raise ValueError(
            f"save_pretrained needs the whole model, got pipeline stage {stage.current_stage} of "
            f"{stage.num_stages}; save stages with d9d.state.save_model_state(..., distributed=True)"
        )
    hf_config = config_to_hf(config)
    dtype = next(model.parameters()).dtype
    hf_config["dtype"] = str(dtype).removeprefix("torch.")
    options: dict[str, Any] = {"overwrite": overwrite, "distributed": False, "progress": False}
    if max_shard_bytes is not None:
        options["max_shard_bytes"] = max_shard_bytes
    dest = save_model_state(path, model, d9d_to_hf_mapper(config, expert_layout=expert_layout), **options)
    (dest / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2) + "\n")
    return dest
