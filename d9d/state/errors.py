"""Errors of the state package: one for how a mapper graph is declared, one for what is on disk.

Both subclass `ValueError` so callers that validate inputs generically still catch them.
"""

from __future__ import annotations


class StateMappingError(ValueError):
    """A mapper graph is inconsistent (collision, missing input, cycle) or a group got the wrong tensors."""


class CheckpointFormatError(ValueError):
    """A checkpoint on disk is unreadable or disagrees with its index or with what the caller expects."""
