"""Token embeddings stored as named vocabulary splits."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn


def check_vocab_splits(splits: Mapping[str, int]) -> dict[str, int]:
    """Validates an ordered name → size mapping; ids are assigned to splits in this order."""
    if not splits:
        raise ValueError("vocabulary splits must name at least one split")
    for name, size in splits.items():
        if size < 1:
            raise ValueError(f"vocabulary split {name!r} has size {size}; sizes must be >= 1")
        if not name.isidentifier():
            raise ValueError(f"vocabulary split name {name!r} must be a Python identifier")
    return dict(splits)


class TokenEmbedding(nn.Module):
    """Embedding table split into named, separately trainable parameters.

    With splits such as `{"regular": 151643, "special": 26}` the ids `[0, 151643)` live in `weights.regular`
    and the rest in `weights.special`, so freezing `weights.regular` trains only the new special tokens
    (the optimizer then holds state for 26 rows, not the whole table). One split is a plain embedding.
    """

    def __init__(self, splits: Mapping[str, int], hidden_size: int, *, init_std: float = 0.02) -> None:
        super().__init__()
        self.splits = check_vocab_splits(splits)
        self.hidden_size = hidden_size
        self.init_std = init_std
        # an OrderedDict: ParameterDict sorts the keys of a plain dict, and split order is id order
        self.weights = nn.ParameterDict(
            OrderedDict(
                (name, nn.Parameter(torch.empty(size, hidden_size))) for name, size in self.splits.items()
            )
        )
        self.reset_parameters()

    @property
    def vocab_size(self) -> int:
        return sum(self.splits.values())

    def reset_parameters(self) -> None:
        for weight in self.weights.values():
            nn.init.normal_(weight, std=self.init_std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` [...] → [..., hidden]."""
        weights = [self.weights[name] for name in self.splits]
        if len(weights) == 1:
            return F.embedding(input_ids, weights[0])
        out: torch.Tensor | None = None
        offset = 0
        for weight in weights:
            local = input_ids - offset
            inside = (local >= 0) & (local < weight.shape[0])
            rows = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
            out = rows if out is None else torch.where(inside[..., None], rows, out)
            offset += weight.shape[0]
        assert out is not None
        return out

    def extra_repr(self) -> str:
        return f"splits={self.splits}, hidden_size={self.hidden_size}"
