"""The language-modelling head: vocabulary logits, or per-token loss through the chunked path."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch
from torch import nn

from d9d.modules.embedding import TokenEmbedding, check_vocab_splits
from d9d.modules.heads.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy, vocab_logits


class CausalLMHead(nn.Module):
    """Projects hidden states onto the vocabulary, split like `TokenEmbedding` so splits train separately.

    `forward(hidden)` returns logits in the hidden dtype; `forward(hidden, labels)` returns the per-token
    float32 loss [batch, seq] (0 where `labels == -100`) computed chunk by chunk, so training never holds
    [tokens, vocab] float32 logits. Labels are already aligned: `labels[b, t]` is the target of position t.
    """

    def __init__(
        self,
        hidden_size: int,
        splits: Mapping[str, int],
        *,
        init_std: float = 0.02,
        loss_chunk_size: int = 1024,
    ) -> None:
        super().__init__()
        self.splits = check_vocab_splits(splits)
        self.init_std = init_std
        self.loss_chunk_size = loss_chunk_size
        # an OrderedDict: ParameterDict sorts the keys of a plain dict, and split order is id order
        self.weights = nn.ParameterDict(
            OrderedDict(
                (name, nn.Parameter(torch.empty(size, hidden_size))) for name, size in self.splits.items()
            )
        )
        self.tied = False
        self.reset_parameters()

    def tie_to(self, embedding: TokenEmbedding) -> None:
        """Share the embedding's parameter container (the same module), so ties survive `to_empty`."""
        if embedding.splits != self.splits:
            raise ValueError(f"cannot tie head splits {self.splits} to embedding splits {embedding.splits}")
        self.weights = embedding.weights
        self.tied = True

    def reset_parameters(self) -> None:
        if self.tied:
            return  # the embedding owns (and initializes) the shared weights
        for weight in self.weights.values():
            nn.init.normal_(weight, std=self.init_std)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        weights = [self.weights[name] for name in self.splits]
        if labels is None:
            return vocab_logits(hidden, weights)
        return linear_cross_entropy(
            hidden, weights, labels, chunk_size=self.loss_chunk_size, ignore_index=IGNORE_INDEX
        )
