"""The MoE feed-forward layer: route, dispatch, run experts, weight, combine, plus an optional shared
expert."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from d9d.modules.checkpointing import is_recomputing
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe.aux_loss import attach_auxiliary_loss, load_balancing_loss
from d9d.modules.moe.communication import (
    MoECommunication,
    PendingDispatch,
    RoutedTokens,
    SharedFn,
    StagedDispatch,
    staged_exchange,
)
from d9d.modules.moe.experts import GroupedExperts
from d9d.modules.moe.local_communication import LocalMoECommunication
from d9d.modules.moe.router import Routing, TopKRouter


@dataclass(frozen=True)
class MoEStart:
    """A part of a batch routed, its dispatch begun (`MoELayer.start`); `MoELayer.finish` completes it."""

    shape: torch.Size
    flat: torch.Tensor  # [tokens, hidden]
    routing: Routing
    pending: PendingDispatch


class MoELayer(nn.Module):
    """A sparse SwiGLU layer. Where experts live is the communication handler's business (local by default;
    expert parallelism swaps in an all-to-all handler through `communication`).

    Statistics for logging (read them with `d9d.modules.moe.stats`): `gate.expert_load` (token copies per
    expert, accumulated), `last_aux_loss` (the balancing loss of the latest forward, detached) and
    `aux_loss_stats` ([sum, forward calls], accumulated until `reset_aux_loss_stats()`). With
    `aux_loss_coef > 0` the gradient of `aux_loss_coef · aux_loss` is added during backward of every
    forward call (so once per microbatch); the value never appears in the model's outputs.

    `batch_parts` (1 unless expert parallelism's `two_batch_overlap` sets 2) tells the decoder layer holding
    this one to split its batch into that many parts and interleave them: part 1's attention runs while part
    0's split sizes travel to the host (`start` / `finish`). Only with a handler that stages its dispatch
    (`StagedDispatch`).
    """

    def __init__(
        self,
        router: TopKRouter,
        experts: GroupedExperts,
        *,
        communication: MoECommunication | None = None,
        shared_expert: SwiGLU | None = None,
        shared_expert_gate: bool = False,
        aux_loss_coef: float = 0.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.gate = router
        self.experts = experts
        self.communication: MoECommunication = (
            communication if communication is not None else LocalMoECommunication()
        )
        self.shared_expert = shared_expert
        hidden_size = router.weight.shape[1]
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert_gate else None
        if shared_expert_gate and shared_expert is None:
            raise ValueError("shared_expert_gate=True needs a shared_expert")
        self.aux_loss_coef = aux_loss_coef
        # When the training objective is a *sum* over tokens later divided by the global token count (as the
        # engine does), the balancing loss must be summed over tokens too, or it shrinks by that count.
        self.aux_loss_per_token = False
        self.init_std = init_std
        self.last_aux_loss: torch.Tensor | None = None
        # [sum of aux losses, forward calls] since the last reset, float32. A plain attribute, not a buffer:
        # `module.to(bfloat16)` would round the running sum.
        self.aux_loss_stats: torch.Tensor | None = None
        self.batch_parts = 1
        if self.shared_expert_gate is not None:  # the injected blocks arrive initialized
            nn.init.normal_(self.shared_expert_gate.weight, std=self.init_std)

    def reset_parameters(self) -> None:
        self.gate.reset_parameters()
        self.experts.reset_parameters()
        if self.shared_expert is not None:
            self.shared_expert.reset_parameters()
        if self.shared_expert_gate is not None:
            nn.init.normal_(self.shared_expert_gate.weight, std=self.init_std)
        self.reset_aux_loss_stats()

    def reset_aux_loss_stats(self) -> None:
        self.aux_loss_stats = None

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`x` [..., hidden] → same shape. `token_mask` [...] (True for real tokens, False for padding)
        keeps padding out of the balancing loss and out of its per-token scale."""
        flat = x.reshape(-1, x.shape[-1])
        routing = self.gate(flat)
        out = self.communication.exchange(self._routed(flat, routing), self.experts, self._shared_fn(flat))
        if torch.is_grad_enabled():  # training: the balancing loss is tracked even when not optimized
            out = self._balancing_loss(out, [routing], [token_mask])
        return out.view_as(x)

    def start(self, x: torch.Tensor) -> MoEStart:
        """Routes `x` [..., hidden] and begins its dispatch, up to the host read of the split sizes: work
        queued after this call runs on the GPU while `finish` waits for that read."""
        staged = self._staged()
        flat = x.reshape(-1, x.shape[-1])
        routing = self.gate(flat)
        return MoEStart(x.shape, flat, routing, staged.begin_dispatch(self._routed(flat, routing)))

    def finish(
        self, starts: Sequence[MoEStart], token_masks: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """The outputs of the parts begun by `start`, in order: together what `forward` gives for them as one
        batch (the balancing loss is computed once, over all of their tokens). `token_masks`: each part's."""
        staged = self._staged()
        outs = [staged_exchange(staged, s.pending, self.experts, self._shared_fn(s.flat)) for s in starts]
        if torch.is_grad_enabled() and outs:
            outs[0] = self._balancing_loss(outs[0], [s.routing for s in starts], token_masks)
        return [out.view(s.shape) for out, s in zip(outs, starts, strict=True)]

    def _staged(self) -> StagedDispatch:
        if not isinstance(self.communication, StagedDispatch):
            raise TypeError(
                f"{type(self.communication).__name__} cannot stage its dispatch: start/finish "
                "(batch_parts > 1) need an exchange that reads split sizes (expert parallelism's all_to_all)"
            )
        return self.communication

    def _routed(self, flat: torch.Tensor, routing: Routing) -> RoutedTokens:
        return RoutedTokens(flat, routing.topk_ids, routing.topk_weights, self.gate.num_experts)

    def _shared_fn(self, flat: torch.Tensor) -> SharedFn | None:
        return None if self.shared_expert is None else functools.partial(self._shared, flat)

    def _shared(self, flat: torch.Tensor) -> torch.Tensor:
        """The shared expert on every token (gated), added to the routed experts' output by `exchange`,
        which may run it while tokens travel."""
        assert self.shared_expert is not None
        shared: torch.Tensor = self.shared_expert(flat)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
        return shared

    def _balancing_loss(
        self, out: torch.Tensor, routings: Sequence[Routing], token_masks: Sequence[torch.Tensor | None]
    ) -> torch.Tensor:
        """`out` with the balancing loss of the tokens of `routings` (the parts of one batch) attached."""
        probs = torch.cat([r.probs for r in routings]) if len(routings) > 1 else routings[0].probs
        ids = torch.cat([r.topk_ids for r in routings]) if len(routings) > 1 else routings[0].topk_ids
        masks = [m.reshape(-1) for m in token_masks if m is not None]
        if masks and len(masks) != len(routings):
            raise ValueError("token masks must be given for every part of the batch or for none")
        mask = (torch.cat(masks) if len(masks) > 1 else masks[0]) if masks else None
        aux = load_balancing_loss(probs, ids, mask)
        if not is_recomputing():
            self.last_aux_loss = aux.detach()
            step = torch.stack([aux.detach().float(), torch.ones_like(aux, dtype=torch.float32)])
            self.aux_loss_stats = step if self.aux_loss_stats is None else self.aux_loss_stats + step
        if self.aux_loss_coef == 0:
            return out
        if self.aux_loss_per_token:  # times the number of real tokens, as the LM loss counts only those
            aux = aux * (mask.sum() if mask is not None else ids.shape[0])
        return attach_auxiliary_loss(out, aux, self.aux_loss_coef)
