"""Loading into and saving from an `nn.Module`: the mapper plus the module's own keys and placements.

Both work per rank: a pipeline stage or expert shard passes its own module, the full-model mapper is
narrowed to that module's keys (`Select`), and DTensor parameters are materialized as this rank's
shard directly (load) or gathered (save).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.state.errors import CheckpointFormatError, StateMappingError
from d9d.state.io.reader import StateReader
from d9d.state.io.writer import StateWriter
from d9d.state.mapper.base import StateMapper
from d9d.state.mapper.module import load_mapper, save_mapper
from d9d.state.mapper.scope import Select


def load_model_state(
    source: str | Path,
    module: nn.Module,
    checkpoint_to_model: StateMapper | None = None,
    *,
    strict: bool = True,
    allow_cast: bool = False,
    progress: bool | None = None,
) -> None:
    """Stream a checkpoint into `module`'s (already materialized) parameters and buffers, in place.

    `checkpoint_to_model` may cover the whole model; only the groups producing this module's keys run.
    `strict` refuses a module key the mapper does not produce; `allow_cast` converts dtypes instead of
    refusing a mismatch. Every check that needs no data runs before the first read.
    """
    targets = module.state_dict()
    for key, t in targets.items():
        if t.is_meta:
            raise CheckpointFormatError(
                f"module tensor {key!r} is on the meta device; materialize the module "
                "(module.to_empty(device=...)) before loading into it"
            )
    narrowed = None if checkpoint_to_model is None else Select(checkpoint_to_model, outputs=targets)
    if strict and narrowed is not None:
        missing = sorted(targets.keys() - narrowed.outputs())
        if missing:
            raise CheckpointFormatError(
                f"the mapper produces no value for {len(missing)} module key(s), e.g. {missing[:5]}; "
                "extend the mapper or pass strict=False"
            )
    placed = targets if narrowed is None else {k: t for k, t in targets.items() if k in narrowed.outputs()}
    reader = StateReader(source, load_mapper(placed, narrowed), progress=progress)
    for _, outputs, files in reader.iter_groups():
        origin = ", ".join(sorted(p.name for p in files)) or "no file"
        for key in sorted(outputs):
            _copy_into(targets[key], outputs.pop(key), key, f"{origin} in {reader.source}", allow_cast)


def _copy_into(target: torch.Tensor, value: torch.Tensor, key: str, origin: str, allow_cast: bool) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise CheckpointFormatError(
            f"{key!r} from {origin}: shape {tuple(value.shape)} does not match the module's "
            f"{tuple(target.shape)}"
        )
    if value.dtype != target.dtype and not allow_cast:
        raise CheckpointFormatError(
            f"{key!r} from {origin}: dtype {value.dtype} does not match the module's {target.dtype} "
            "(add a Cast to the mapper or pass allow_cast=True)"
        )
    if isinstance(target, DTensor):
        if not isinstance(value, DTensor) or value.placements != target.placements:
            raise CheckpointFormatError(f"{key!r} from {origin}: not placed like the module's DTensor")
        target.to_local().copy_(value.to_local())
    else:
        target.copy_(value)


def save_model_state(
    dest: str | Path,
    state: nn.Module | Sequence[nn.Module] | Mapping[str, torch.Tensor],
    model_to_checkpoint: StateMapper | None = None,
    **writer_options: Any,
) -> Path:
    """Save this rank's state — a module, several (virtual pipeline stages), or a state dict — with
    DTensors gathered and optionally converted (e.g. d9d -> HF). Distributed: call on every rank.

    A full-model `model_to_checkpoint` is narrowed to the groups whose inputs this rank holds.
    `writer_options` go to `StateWriter` (max_shard_bytes, overwrite, distributed, write, extra_files, ...).
    """
    if isinstance(state, nn.Module):
        tensors = state.state_dict()
    elif isinstance(state, Mapping):
        tensors = dict(state)
    else:
        tensors = {}
        for module in state:
            for key, tensor in module.state_dict().items():
                if key in tensors:
                    raise StateMappingError(f"{key!r} is in two of the modules given to save_model_state")
                tensors[key] = tensor
    narrowed = None if model_to_checkpoint is None else Select(model_to_checkpoint, inputs=tensors)
    mapper = save_mapper(tensors, narrowed)
    needed = mapper.inputs()
    with StateWriter(dest, mapper, **writer_options) as writer:
        writer.update({k: t for k, t in tensors.items() if k in needed})
    return writer.dest
