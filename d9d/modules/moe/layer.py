"""The MoE feed-forward layer: route, dispatch, run experts, weight, combine, plus an optional shared
expert."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

from d9d.modules.checkpointing import is_recomputing
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe.aux_loss import attach_auxiliary_loss, balancing_loss_over, load_balancing_loss
from d9d.modules.moe.communication import MoECommunication, RoutedTokens
from d9d.modules.moe.experts import GroupedExperts
from d9d.modules.moe.local_communication import LocalMoECommunication
from d9d.modules.moe.router import Routing, TopKRouter


class MoELayer(nn.Module):
    """A sparse SwiGLU layer. Where experts live is the communication handler's business (local by default;
    expert parallelism swaps in an all-to-all handler through `communication`).

    Statistics for logging (read them with `d9d.modules.moe.stats`): `gate.expert_load` (real tokens'
    copies per expert, accumulated; padding is not counted), `last_aux_loss` (the balancing loss of the
    latest forward, detached) and `aux_loss_stats` ([sum, forward calls], accumulated until
    `reset_aux_loss_stats()`). With `aux_loss_coef > 0` the gradient of `aux_loss_coef · aux_loss` is added
    during backward of every forward call (so once per microbatch); the value never appears in the model's
    outputs.
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
        # Groups of ranks that route other tokens of the same sequences (tensor- and context-parallel ranks,
        # set by their plans through `shares_tokens_with`): the balancing loss is computed over all of them.
        self.token_groups: tuple[dist.ProcessGroup, ...] = ()
        self.init_std = init_std
        self.last_aux_loss: torch.Tensor | None = None
        # [sum of aux losses, forward calls] since the last reset, float32. A plain attribute, not a buffer:
        # `module.to(bfloat16)` would round the running sum.
        self.aux_loss_stats: torch.Tensor | None = None
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

    def shares_tokens_with(self, group: dist.ProcessGroup) -> None:
        """The ranks of `group` route other tokens of the same sequences as this rank (a token split): the
        balancing loss and its statistics are taken over all their tokens, as one process would."""
        self.token_groups = (*self.token_groups, group)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`x` [..., hidden] → same shape. `token_mask` [...] (True for real tokens, False for padding)
        keeps padding out of the balancing loss and out of its per-token scale."""
        flat = x.reshape(-1, x.shape[-1])
        routing = self.gate(flat, None if token_mask is None else token_mask.reshape(-1))
        out = self.communication.exchange(
            RoutedTokens(flat, routing.topk_ids, routing.topk_weights, self.gate.num_experts),
            self.experts,
            None if self.shared_expert is None else functools.partial(self._shared, flat),
        )
        if torch.is_grad_enabled():  # training: the balancing loss is tracked even when not optimized
            out = self._balancing_loss(out, routing, token_mask)
        return out.view_as(x)

    def _shared(self, flat: torch.Tensor) -> torch.Tensor:
        """The shared expert on every token (gated), added to the routed experts' output by `exchange`,
        which may run it while tokens travel."""
        assert self.shared_expert is not None
        shared: torch.Tensor = self.shared_expert(flat)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
        return shared

    def _balancing_loss(
        self, out: torch.Tensor, routing: Routing, token_mask: torch.Tensor | None
    ) -> torch.Tensor:
        mask = token_mask.reshape(-1) if token_mask is not None else None
        recomputing = is_recomputing()
        weighted = self.aux_loss_coef != 0
        if recomputing and not weighted:
            return out
        # Unweighted it is only a statistic: no autograd graph (nothing saved, so an activation checkpoint's
        # recompute, which skips it, saves as many tensors as the forward did).
        with contextlib.nullcontext() if weighted else torch.no_grad():
            real_tokens: torch.Tensor | int
            if self.token_groups:
                aux, tracked, real_tokens = balancing_loss_over(
                    routing.probs, routing.topk_ids, mask, self._sum_over_token_groups
                )
            else:
                aux = tracked = load_balancing_loss(routing.probs, routing.topk_ids, mask)
                real_tokens = mask.sum() if mask is not None else routing.topk_ids.shape[0]
        if not recomputing:
            self.last_aux_loss = tracked.detach()
            step = torch.stack([tracked.detach().float(), torch.ones_like(tracked, dtype=torch.float32)])
            self.aux_loss_stats = step if self.aux_loss_stats is None else self.aux_loss_stats + step
        if not weighted:
            return out
        if self.aux_loss_per_token:  # times the number of real tokens, as the LM loss counts only those
            aux = aux * real_tokens
        return attach_auxiliary_loss(out, aux, self.aux_loss_coef)

    # Traced inside a compiled block (no graph break, as the tensor-parallel plan's own collectives): a
    # break here would fail `compile.fullgraph` and the traced op-level activation checkpoint.
    def _sum_over_token_groups(self, t: torch.Tensor) -> torch.Tensor:
        for group in self.token_groups:  # a sum over each group in turn is the sum over their product
            dist.all_reduce(t, group=group)
        return t
