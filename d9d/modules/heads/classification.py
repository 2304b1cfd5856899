"""Sequence classification: pool one token, project to class logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from d9d.modules.heads.linear_cross_entropy import IGNORE_INDEX
from d9d.modules.heads.pooling import Pooling, pool


class SequenceClassificationHead(nn.Module):
    """Logits [batch, num_labels] from the pooled hidden state (default: the last real token, which has seen
    the whole sequence under causal attention); with labels, the per-sample float32 loss [batch]."""

    def __init__(
        self, hidden_size: int, num_labels: int, *, pooling: Pooling = "last", init_std: float = 0.02
    ) -> None:
        super().__init__()
        self.pooling: Pooling = pooling
        self.init_std = init_std
        self.score = nn.Linear(hidden_size, num_labels, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.score.weight, std=self.init_std)

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        logits: torch.Tensor = self.score(pool(hidden, attention_mask, self.pooling))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
