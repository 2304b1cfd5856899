"""Flatten computed metric values into `name -> float` pairs, the shape trackers take."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def to_scalars(values: Any, prefix: str = "", sep: str = "/") -> dict[str, float]:
    """Nested dicts become `a/b/c` names; a tensor with several elements gets one name per element
    (`precision/0`, `precision/1`, ...); numbers pass through. Anything else is refused by name."""
    out: dict[str, float] = {}
    if isinstance(values, Mapping):
        for key, value in values.items():
            out.update(to_scalars(value, f"{prefix}{sep}{key}" if prefix else str(key), sep))
    elif isinstance(values, torch.Tensor):
        flat = values.detach().cpu().double().reshape(-1).tolist()
        if values.dim() == 0:
            out[prefix] = flat[0]
        else:
            out.update({f"{prefix}{sep}{i}": v for i, v in enumerate(flat)})
    elif isinstance(values, int | float) and not isinstance(values, bool):
        out[prefix] = float(values)
    else:
        raise TypeError(f"to_scalars: {prefix or 'value'!r} is a {type(values).__name__}, not a number")
    return out
