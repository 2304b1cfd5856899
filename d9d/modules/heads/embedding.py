"""Sentence embeddings: pool, optionally project, optionally L2-normalize."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from d9d.modules.heads.pooling import Pooling, pool


class EmbeddingHead(nn.Module):
    """[batch, seq, hidden] → [batch, dim]; the contrastive loss belongs to the task, not the head."""

    def __init__(
        self,
        hidden_size: int,
        *,
        pooling: Pooling = "last",
        projection_dim: int | None = None,
        normalize: bool = True,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.pooling: Pooling = pooling
        self.normalize = normalize
        self.init_std = init_std
        self.projection = nn.Linear(hidden_size, projection_dim, bias=False) if projection_dim else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.projection is not None:
            nn.init.normal_(self.projection.weight, std=self.init_std)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        out = pool(hidden, attention_mask, self.pooling)
        if self.projection is not None:
            out = self.projection(out)
        return F.normalize(out, dim=-1) if self.normalize else out
