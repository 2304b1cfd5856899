"""The hook point between an MoE layer and where its experts live.

The MoE layer routes tokens (top-k ids and weights), then asks a communication handler to *dispatch*
token copies to the experts that own them and, after the experts ran, to *combine* the results back into
token order. The default handler is a local permutation; expert parallelism swaps in an all-to-all or
DeepEP handler (`d9d.parallel`) without the layer changing.

Contract, for every handler:
- `dispatch` returns the rows each *local* expert must process, grouped by local expert in ascending
  order, with `tokens_per_expert[i]` rows for local expert `i` (a handler may add zero padding rows to a
  group, e.g. to align groups for the grouped matmul, and padding rows after the last group, e.g. a
  static-capacity exchange; the experts leave those unspecified and `combine` ignores them).
- `combine` takes the experts' (unweighted) outputs and returns, per source token,
  out[t] = Σ_k w[t,k] · expert_{id[t,k]}(x[t]): the routing weights are applied by the handler, so each
  can fuse them into its own combine.
- `exchange` is what the layer calls: dispatch, the experts, combine, plus the result of `shared` (the
  layer's shared expert, which needs no exchange). Most handlers do exactly that, in that order
  (`sequential_exchange`); one may overlap its communication with the experts' and the shared expert's
  compute instead (the all-to-all handler's `overlap_chunks`), with the same result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class RoutedTokens:
    """The router's decision for a flat batch of tokens: what every handler's `dispatch` starts from."""

    hidden_states: torch.Tensor  # [tokens, hidden]
    topk_ids: torch.Tensor  # [tokens, k] global expert ids
    topk_weights: torch.Tensor  # [tokens, k] routing weights
    num_experts: int

    def local_experts(self, ep_size: int) -> int:
        """Experts per rank when the `num_experts` are split evenly over `ep_size` ranks."""
        if self.num_experts % ep_size:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel size {ep_size}"
            )
        return self.num_experts // ep_size


@dataclass
class DispatchedTokens:
    hidden_states: torch.Tensor  # [rows, hidden], grouped by local expert
    tokens_per_expert: torch.Tensor  # [num_local_experts], int64, rows per local expert
    state: Any  # handler-private data that `combine` needs (permutation, weights, split sizes, ...)


@runtime_checkable
class MoECommunication(Protocol):
    def dispatch(self, routed: RoutedTokens) -> DispatchedTokens: ...

    def combine(self, expert_outputs: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        """`expert_outputs` [rows, hidden], unweighted → [tokens, hidden], weighted sum per token."""
        ...

    def exchange(
        self, routed: RoutedTokens, experts: ExpertsFn, shared: SharedFn | None = None
    ) -> torch.Tensor:
        """[tokens, hidden]: `combine` of `experts` run on what `dispatch` sent this rank, plus `shared()`."""
        ...


ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""The local experts: (rows grouped by local expert, rows per local expert) → their unweighted outputs."""
SharedFn = Callable[[], torch.Tensor]
"""Work on this rank's own tokens that needs no exchange (the shared expert): [tokens, hidden], added."""


def sequential_exchange(
    communication: MoECommunication, routed: RoutedTokens, experts: ExpertsFn, shared: SharedFn | None
) -> torch.Tensor:
    """Dispatch, run the experts, combine, then add `shared()`: one after the other."""
    dispatched = communication.dispatch(routed)
    rows = experts(dispatched.hidden_states, dispatched.tokens_per_expert)
    out = communication.combine(rows, dispatched)
    return out if shared is None else out + shared()
