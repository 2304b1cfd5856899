"""Mappers derived from a module's own state: identity, and DTensor distribute/gather around a model mapper.

Each takes a module or its state dict (or the part of it one rank loads). The module (possibly on the
meta device, possibly already parallelized) is the source of truth for which keys exist and how each
is placed, so loading and saving never hard-code a layout.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.state.mapper.base import StateMapper
from d9d.state.mapper.compose import Parallel, Sequential
from d9d.state.mapper.dtensor import Distribute, Gather, ShardingSpec
from d9d.state.mapper.keys import Identity

ModuleState = nn.Module | Mapping[str, torch.Tensor]


def _state(module: ModuleState) -> Mapping[str, torch.Tensor]:
    return module.state_dict() if isinstance(module, nn.Module) else module


def _split_placed(module: ModuleState) -> tuple[list[str], dict[str, ShardingSpec]]:
    plain: list[str] = []
    placed: dict[str, ShardingSpec] = {}
    for key, tensor in _state(module).items():
        if isinstance(tensor, DTensor):
            placed[key] = ShardingSpec.of(tensor)
        else:
            plain.append(key)
    return plain, placed


def identity_mapper(module: ModuleState) -> Identity:
    """Every state-dict key (parameters and persistent buffers) passed through unchanged."""
    return Identity(_state(module).keys())


def distribute_mapper(module: ModuleState) -> StateMapper:
    """Identity for plain tensors, `Distribute` into each DTensor's mesh and placements for the rest."""
    plain, placed = _split_placed(module)
    return Parallel([Identity(plain), Distribute(placed)])


def gather_mapper(module: ModuleState) -> StateMapper:
    """Identity for plain tensors, `Gather` (a collective) for DTensors: the full state for saving."""
    plain, placed = _split_placed(module)
    return Parallel([Identity(plain), Gather(placed)])


def load_mapper(module: ModuleState, checkpoint_to_model: StateMapper | None = None) -> StateMapper:
    """Checkpoint keys -> this module's keys, materialized as its DTensor shards.

    `checkpoint_to_model` converts the checkpoint's layout (e.g. an HF -> d9d mapper restricted to this
    rank's keys); None means the checkpoint already uses the module's keys.
    """
    place = distribute_mapper(module)
    return place if checkpoint_to_model is None else Sequential([checkpoint_to_model, place])


def save_mapper(module: ModuleState, model_to_checkpoint: StateMapper | None = None) -> StateMapper:
    """This module's (possibly sharded) state -> full tensors in the checkpoint's layout."""
    full = gather_mapper(module)
    return full if model_to_checkpoint is None else Sequential([full, model_to_checkpoint])
