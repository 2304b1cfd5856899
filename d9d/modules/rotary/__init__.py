"""Rotary position embeddings with optional frequency scaling."""

from d9d.modules.rotary.embedding import RotaryEmbedding, RotaryStyle, RotaryTables
from d9d.modules.rotary.scaling import (
    DynamicNTKRopeScaling,
    LinearRopeScaling,
    NoRopeScaling,
    RopeScaling,
    YarnRopeScaling,
    rope_frequencies,
)

__all__ = [
    "DynamicNTKRopeScaling",
    "LinearRopeScaling",
    "NoRopeScaling",
    "RopeScaling",
    "RotaryEmbedding",
    "RotaryStyle",
    "RotaryTables",
    "YarnRopeScaling",
    "rope_frequencies",
]
