"""Configuration errors, shared by the config tree and the plug-in registry (neither imports the other's
internals to report a problem)."""

from __future__ import annotations

from pydantic import ValidationError

# Prefix of the tags that pick a built-in provider in a component union; pydantic puts the tag in an
# error's location, but the user wrote `model.options.x`, not `model.<tag>.options.x`, so it is dropped.
UNION_TAG_PREFIX = "provider="


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted field path."""


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    lines = []
    for item in error.errors():
        parts = [str(p) for p in item["loc"] if not str(p).startswith(UNION_TAG_PREFIX)]
        path = ".".join(parts)
        full = f"{prefix}.{path}" if prefix and path else (prefix or path)
        lines.append(f"{full or '<root>'}: {item['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
