"""What a dataset needs from a tokenizer: text ↔ ids and the ids of a few special tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens (datasets add bos/eos themselves)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping special tokens."""
        ...
