"""The built-in model families, in the order the config reference lists them. Adding one is one line here:
its package (`d9d/models/<family>/`) registers its `ModelFamily` when imported and names it `FAMILY`."""

from __future__ import annotations

import importlib

_PACKAGES = (
    "d9d.models.qwen3",
    "d9d.models.qwen3_moe",
    "d9d.models.llama3",
    "d9d.models.deepseek_v3",
)

BUILTIN_FAMILIES: tuple[str, ...] = tuple(importlib.import_module(p).FAMILY.name for p in _PACKAGES)
