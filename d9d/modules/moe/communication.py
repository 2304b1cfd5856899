"""The hook point between an MoE layer and where its experts live.

The MoE layer routes tokens (top-k ids and weights), then asks a communication handler to *dispatch*
token copies to the experts that own them and, after the experts ran, to *combine* the results back into
token order. The default handler is a local permutation; expert parallelism swaps in an all-to-all or
DeepEP handler (`d9d.parallel`) without the layer changing.

Contract, for every handler:
- `dispatch` returns the rows each *local* expert must process, grouped by local expert in ascending
  order, with `tokens_per_expert[i]` rows for local expert `i`, and `row_weights` holding each row's
  routing weight.
- The layer multiplies expert outputs by `row_weights` (so all backends weight the same way), then
  `combine` sums every row back into its source token: out[t] = Σ_k w[t,k] · expert_{id[t,k]}(x[t]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class DispatchedTokens:
    hidden_states: torch.Tensor  # [rows, hidden], grouped by local expert
    tokens_per_expert: torch.Tensor  # [num_local_experts], int64
    row_weights: torch.Tensor  # [rows], routing weight of each row
    state: Any  # handler-private data that `combine` needs (permutation, split sizes, ...)


@runtime_checkable
class MoECommunication(Protocol):
    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        num_experts: int,
    ) -> DispatchedTokens:
        """`hidden_states` [tokens, hidden]; `topk_ids` / `topk_weights` [tokens, k] (global expert ids)."""
        ...

    def combine(self, expert_outputs: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        """`expert_outputs` [rows, hidden], already multiplied by `row_weights` → [tokens, hidden]."""
        ...
