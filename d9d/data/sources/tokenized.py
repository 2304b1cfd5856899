"""Documents → token-id samples."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from d9d.data.protocols import SizedDataset, Stateful
from d9d.data.state import check_state_matches
from d9d.data.tokenizers.protocol import Tokenizer


def _special(tokenizer: Tokenizer, token_id: int | None, name: str) -> list[int]:
    if token_id is None:
        raise ValueError(f"add_{name}=True but tokenizer {tokenizer!r} has no {name} token")
    return [token_id]


class TokenizedDataset:
    """`ds[i] == {"input_ids": LongTensor}`: document `i` tokenized, with bos/eos added if asked.

    `max_length` truncates (keeping the start and, when `add_eos`, still ending with eos); splitting long
    documents or packing short ones is the collator's job, so sample `i` always means document `i`.
    """

    def __init__(
        self,
        documents: SizedDataset[str],
        tokenizer: Tokenizer,
        *,
        add_bos: bool = True,
        add_eos: bool = True,
        max_length: int | None = None,
    ) -> None:
        self._prefix = _special(tokenizer, tokenizer.bos_id, "bos") if add_bos else []
        self._suffix = _special(tokenizer, tokenizer.eos_id, "eos") if add_eos else []
        specials = len(self._prefix) + len(self._suffix)
        if max_length is not None and max_length <= specials:
            raise ValueError(
                f"max_length={max_length} leaves no room for text next to {specials} special tokens"
            )
        self.documents = documents
        self.tokenizer = tokenizer
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.documents)

    def token_ids(self, index: int) -> list[int]:
        ids = self.tokenizer.encode(self.documents[index])
        if self.max_length is not None:
            ids = ids[: self.max_length - len(self._prefix) - len(self._suffix)]
        return self._prefix + ids + self._suffix

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor(self.token_ids(index), dtype=torch.long)}

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "tokenizer": type(self.tokenizer).__name__,
            "vocab_size": self.tokenizer.vocab_size,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "max_length": self.max_length,
        }

    def state_dict(self) -> dict[str, Any]:
        state = self._fingerprint()
        if isinstance(self.documents, Stateful):
            state["documents"] = self.documents.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_matches("tokenized dataset", state, self._fingerprint())
        if isinstance(self.documents, Stateful):
            self.documents.load_state_dict(state["documents"])
