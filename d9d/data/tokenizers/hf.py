"""A Hugging Face `tokenizer.json` through the `tokenizers` package (no `transformers` needed).

`tokenizer.json` does not say which tokens are bos/eos/pad — that lives in the sibling
`tokenizer_config.json`. They can be given explicitly, otherwise they are read from there when present.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _token_name(entry: Any) -> str | None:
    # tokenizer_config.json stores a special token either as a string or as {"content": ..., ...}.
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return str(entry["content"])
    return None


class HFTokenizer:
    def __init__(
        self,
        path: Path | str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> None:
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("HFTokenizer needs the `tokenizers` package (pip install 'd9d[hf]')") from e
        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / "tokenizer.json"
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {self.path} does not exist")
        self._tok = _RustTokenizer.from_file(str(self.path))
        # A tokenizer.json may carry truncation and padding settings (saved from a pipeline that used them):
        # applied to whole documents they would cut each one short, or put pad ids inside it that then train
        # as real tokens. Length is the dataset's business (`max_length`, packing) and padding the collator's.
        self._tok.no_truncation()
        self._tok.no_padding()
        defaults = self._config_tokens()
        self._bos = self._special_id("bos_token", bos_token or defaults.get("bos_token"))
        self._eos = self._special_id("eos_token", eos_token or defaults.get("eos_token"))
        self._pad = self._special_id("pad_token", pad_token or defaults.get("pad_token"))

    def _config_tokens(self) -> dict[str, str]:
        config = self.path.with_name("tokenizer_config.json")
        if not config.is_file():
            return {}
        data = json.loads(config.read_text())
        names = {key: _token_name(data.get(key)) for key in ("bos_token", "eos_token", "pad_token")}
        return {key: name for key, name in names.items() if name is not None}

    def _special_id(self, role: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{role}={token!r} is not in the vocabulary of {self.path}")
        return int(token_id)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def pad_id(self) -> int | None:
        return self._pad

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"
