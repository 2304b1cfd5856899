"""Configuration errors, shared by the config tree and the plug-in registry (neither imports the other's
internals to report a problem)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails

# Prefix of the tags that pick a built-in provider in a component union; pydantic puts the tag in an
# error's location, but the user wrote `model.options.x`, not `model.<tag>.options.x`, so it is dropped.
UNION_TAG_PREFIX = "provider="
_UNSET: Any = object()


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted field path."""


def format_validation_error(error: ValidationError, prefix: str = "", data: Any = _UNSET) -> str:
    """One `dotted.path: message` line per error. With `data` (the validated input), each path is the one
    the user wrote: the discriminator tags pydantic puts in a location (`provider=...`, a dataset's
    `files`) are dropped wherever the input has no such key."""
    lines = []
    for item in error.errors():
        loc = item["loc"]
        if data is _UNSET:
            parts = [str(p) for p in loc if not str(p).startswith(UNION_TAG_PREFIX)]
        else:
            parts = _as_written(loc, data)
        path = ".".join(parts)
        full = f"{prefix}.{path}" if prefix and path else (prefix or path)
        lines.append(f"{full or '<root>'}: {item['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _as_written(loc: tuple[int | str, ...], data: Any) -> list[str]:
    """`loc` less the parts that are not keys of the input: a part absent from the input mapping while
    the next part is present there is a union tag; the last part (a missing or extra key) is kept."""
    parts: list[str] = []
    node: Any = data
    for i, part in enumerate(loc):
        if isinstance(node, Mapping) and part in node:
            parts.append(str(part))
            node = node[part]
            continue
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            parts.append(str(part))
            node = node[part]
            continue
        rest = loc[i + 1 :]
        if str(part).startswith(UNION_TAG_PREFIX) or (rest and isinstance(node, Mapping) and rest[0] in node):
            continue
        if isinstance(node, Mapping) and part in {v for v in node.values() if isinstance(v, str)}:
            continue  # the tag of a discriminated union (`mode: selective`) that a model validator refused
        parts.append(str(part))
        node = None
    return parts


def prefixed(error: ValidationError, *loc: str | int) -> ValidationError:
    """`error` with every location under `loc`: a model validated inside a validator keeps its field path
    (`architecture.num_expert`, not `num_expert`)."""
    details = [
        InitErrorDetails(
            type=item["type"], loc=(*loc, *item["loc"]), input=item["input"], ctx=item.get("ctx", {})
        )
        for item in error.errors()
    ]
    return ValidationError.from_exception_data(error.title, details)
