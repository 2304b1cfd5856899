"""Activation checkpointing."""

from d9d.modules.checkpointing.activation import checkpointed, is_recomputing

__all__ = ["checkpointed", "is_recomputing"]
