"""Refusing a resume that would silently read different data."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_state_matches(owner: str, saved: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raise naming every key whose saved value differs from what this object was built with."""
    diffs = [
        f"{key}: checkpoint has {saved.get(key, '<missing>')!r}, this run has {value!r}"
        for key, value in expected.items()
        if saved.get(key, "<missing>") != value
    ]
    if diffs:
        raise ValueError(f"cannot resume {owner} from this state: " + "; ".join(diffs))
