"""A tokenizer with no dependencies and no files: one token per UTF-8 byte, plus three specials.

It exists so that the demo and the tests can train a language model with nothing downloaded. Any text
round-trips exactly, since every byte has a token; ids 256.. are the special tokens, so text that happens
to contain "<eos>" is encoded as its bytes and can never inject a special token.
"""

from __future__ import annotations

from collections.abc import Sequence

_NUM_BYTES = 256


class ByteTokenizer:
    bos_id: int = _NUM_BYTES
    eos_id: int = _NUM_BYTES + 1
    pad_id: int = _NUM_BYTES + 2
    vocab_size: int = _NUM_BYTES + 3

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is outside the byte tokenizer's vocabulary [0, {self.vocab_size})"
                )
        # Ids cut mid-character (e.g. a truncated sample) decode to U+FFFD instead of failing.
        return bytes(i for i in ids if i < _NUM_BYTES).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
