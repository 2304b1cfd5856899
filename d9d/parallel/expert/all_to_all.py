"""Expert-parallel token exchange over `torch.distributed.all_to_all_single` (gloo and NCCL).

Experts are split evenly over the `ep` ranks: rank r owns global experts [r·L, (r+1)·L), L = E / ep.

Deduplicated exchange (`dedup=True`): a token travels once to each rank that hosts at least
one of its k experts, not once per expert. With its row go its k expert ids translated to the receiver's
local ids (-1 for experts elsewhere) and its k routing weights (0 there). The receiver expands each row
into one row per local copy, grouped by local expert (what `GroupedExperts` reads); after the experts ran
it sums a row's copies weighted by the weights that came with it, and sends ONE row back per (token,
rank); the sender adds a token's ≤ ep partial rows. At 64 experts top-8 a token's experts sit on ≈ 3.7 of
4 ranks (≈ 2 of 2), so dispatch and combine move ≈ 2.2× (≈ 4×) fewer bytes than one row per copy.

Copy exchange (`dedup=False`, the default: faster on 4 × H100 and 4 × H200, docs/parallelism.md): one row
per (token, expert) copy, permuted by global expert; the receiver regroups the rows by local expert and
back with the permute/gather kernels (a gather in both directions of the backward, no atomics); combine
returns the copies and each token sums its k rows weighted by its routing weights (which never travel).

Both: one small all-to-all of counts, then one device→host copy of the split sizes (the only host sync
of a dispatch; the copy exchange with a calibrated `ExchangeCapacity` skips it and sends a fixed number of
rows to every peer, capacity.py), then one all-to-all of the rows (with their weights and ids in the
deduplicated exchange, side by side in one byte message); combine and every backward reuse the stored
splits. Every step is differentiable: the all-to-all's backward is the reverse all-to-all, and the routing
weights get their gradient through the combine (back across the rows' message in the deduplicated
exchange).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from d9d.kernels.backend import KernelBackend
from d9d.kernels.moe import (
    ExpertPermutation,
    block_regroup,
    combine_tokens,
    expert_permutation,
    permute_tokens,
)
from d9d.modules.moe.communication import (
    DispatchedTokens,
    ExpertsFn,
    RoutedTokens,
    SharedFn,
    sequential_exchange,
)
from d9d.parallel.expert.capacity import ExchangeCapacity
from d9d.parallel.expert.overlap import land, launch


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable `all_to_all_single` along dim 0 with per-rank row counts."""
    out: torch.Tensor = _AllToAll.apply(x, output_splits, input_splits, group)
    return out


def _row_numel(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[rows, ...] → [rows, bytes per row] uint8 (a view of `t`, or of a contiguous copy)."""
    return t.contiguous().view(t.shape[0], _row_numel(t)).view(torch.uint8)


def _from_bytes(packed: torch.Tensor, start: int, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The columns of `packed` from `start` holding one row of `like`'s dtype and row shape, as such."""
    width = _row_numel(like) * like.element_size()
    # copied into a fresh [rows, width] buffer: a dtype view needs a row stride the element size divides
    # (`.contiguous()` keeps the packed stride when there is a single row)
    part = packed.new_empty((packed.shape[0], width)).copy_(packed[:, start : start + width])
    return part.view(like.dtype).view(packed.shape[0], *like.shape[1:]), start + width


def _packed_exchange(
    tensors: list[torch.Tensor], output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """`tensors` (same row count) as one uint8 message through `all_to_all_single`, unpacked as they were."""
    packed = _all_to_all(torch.cat([_as_bytes(t) for t in tensors], 1), output_splits, input_splits, group)
    out, start = [], 0
    for t in tensors:
        part, start = _from_bytes(packed, start, t)
        out.append(part)
    return out


class _PackedAllToAll(torch.autograd.Function):
    """Row-aligned tensors of different dtypes through ONE `all_to_all_single`: each row's bytes side by
    side, a uint8 message. One collective instead of one per tensor: on a step bound by the host and by
    ranks meeting in every collective, each all-to-all costs a launch and a rendezvous. The backward sends
    the differentiable tensors' gradients back the same way (integer tensors get none)."""

    @staticmethod
    def forward(
        ctx: Any,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        ctx.differentiable = [t.is_floating_point() for t in tensors]
        out = _packed_exchange(list(tensors), output_splits, input_splits, group)
        ctx.mark_non_differentiable(*(o for o, d in zip(out, ctx.differentiable, strict=True) if not d))
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        moving = [g for g, d in zip(grads, ctx.differentiable, strict=True) if d]
        assert all(g is not None for g in moving)  # materialized by autograd (zeros where unused)
        moved = iter(_packed_exchange(moving, input_splits, output_splits, ctx.group))  # type: ignore[arg-type]
        return (None, None, None, *(next(moved) if d else None for d in ctx.differentiable))


def packed_all_to_all(
    tensors: tuple[torch.Tensor, ...],
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, ...]:
    """`all_to_all` of several row-aligned tensors (same row count, any dtypes) as one message;
    differentiable in the floating-point ones."""
    out: tuple[torch.Tensor, ...] = _PackedAllToAll.apply(output_splits, input_splits, group, *tensors)
    return out


@dataclass(frozen=True)
class _CopyState:
    slot_rows: torch.Tensor  # [tokens, k]: send-buffer row of each copy
    weights: torch.Tensor  # [tokens, k]: routing weights, applied where the copies return
    regroup: torch.Tensor  # [received rows, 1]: local-expert-major row of each received row
    send_splits: list[int]
    recv_splits: list[int]
    static: bool  # the capacity's split sizes (traceable, functional collectives), not read ones


@dataclass(frozen=True)
class _DedupState:
    send_slots: torch.Tensor  # [tokens, ep]: send-buffer row of (token, rank), -1 where not sent
    recv_slots: torch.Tensor  # [received rows, k]: expert-grouped row of each local copy, -1 elsewhere
    recv_weights: torch.Tensor  # [received rows, k]: routing weights that came with the rows, 0 elsewhere
    send_splits: list[int]
    recv_splits: list[int]


class AllToAllMoECommunication:
    """`MoECommunication` over an expert-parallel process group with plain all-to-all collectives.

    `dedup=False` (default) sends and returns one row per (token, expert) copy; `dedup=True` sends a token
    once per destination rank and returns one weighted partial sum per (token, rank) (module docstring).
    `overlap_chunks > 1` (copy exchange, reading its split sizes): `exchange` splits the tokens into that many
    chunks whose transfers overlap the other chunks' expert compute (`_exchange_overlapped`)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        backend: KernelBackend = "auto",
        dedup: bool = False,
        capacity: ExchangeCapacity | None = None,
        overlap_chunks: int = 1,
    ) -> None:
        if dedup and capacity is not None:
            raise ValueError("a static exchange capacity is implemented for the copy exchange (dedup=False)")
        if overlap_chunks < 1:
            raise ValueError(f"overlap_chunks={overlap_chunks} must be >= 1")
        if overlap_chunks > 1 and (dedup or capacity is not None):
            raise ValueError(
                "overlap_chunks > 1 is implemented for the copy exchange that reads its split sizes: "
                "dedup=False and no capacity"
            )
        self.group = group
        self.size = dist.get_world_size(group)
        self.backend: KernelBackend = backend
        self.dedup = dedup
        self.capacity = capacity
        self.overlap_chunks = overlap_chunks

    def exchange(
        self, routed: RoutedTokens, experts: ExpertsFn, shared: SharedFn | None = None
    ) -> torch.Tensor:
        if self.overlap_chunks == 1:
            return sequential_exchange(self, routed, experts, shared)
        out: torch.Tensor = self._exchange_overlapped(routed, experts, shared)  # typed Any by the decorator
        return out

    def dispatch(self, routed: RoutedTokens) -> DispatchedTokens:
        # The calibrated capacity's split sizes are Python ints the host knows: that dispatch reads nothing
        # from the device, so inside a compiled MoE block it is traced with the rest of the layer (its
        # collectives functional, `_dispatch_copies_capacity`) and the layer stays one graph. Only where the
        # engine reads the overflow flag: a training forward (evaluation and inference run without
        # gradients and take the exact, reading path).
        capacity = self.capacity if torch.is_grad_enabled() else None
        if capacity is not None and capacity.rows is not None:
            return self._dispatch_copies_capacity(routed, capacity)
        dispatched: DispatchedTokens = self._dispatch_reading(routed, capacity)  # typed Any by the decorator
        return dispatched

    def combine(self, expert_outputs: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        state = dispatched.state
        if isinstance(state, _CopyState) and state.static:
            return self._combine_copies(expert_outputs, state)  # traced, as its dispatch
        out: torch.Tensor = self._combine_reading(expert_outputs, dispatched)  # typed Any by the decorator
        return out

    # Eager even inside a compiled MoE block: the host read of the split sizes breaks the graph anyway, and
    # traced by inductor on CUDA (c10d's in-place collectives inside autograd Functions) this exchange
    # trained wrong (a dp 2 × ep 2 run left the one-GPU losses at the second step, 1.6e-2 apart after 8;
    # eager, 1e-7), while gloo/CPU inductor was exact.
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _dispatch_reading(self, routed: RoutedTokens, capacity: ExchangeCapacity | None) -> DispatchedTokens:
        if self.dedup:
            return self._dispatch_dedup(routed)
        return self._dispatch_copies(routed, capacity)

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _combine_reading(self, expert_outputs: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        state = dispatched.state
        if isinstance(state, _DedupState):
            return self._combine_dedup(expert_outputs, state)
        return self._combine_copies(expert_outputs, state)

    # -- one row per (token, rank) -----------------------------------------------------------------------

    def _dispatch_dedup(self, routed: RoutedTokens) -> DispatchedTokens:
        local_experts = routed.local_experts(self.size)
        ids, weights = routed.topk_ids, routed.topk_weights
        tokens, k = ids.shape
        ranks = torch.arange(self.size, device=ids.device)
        on_rank = (ids // local_experts)[None] == ranks[:, None, None]  # [ep, tokens, k]
        to_rank = on_rank.any(2)  # [ep, tokens]: token t goes to rank r
        send_counts = torch.stack([to_rank.sum(1), on_rank.sum((1, 2))], 1)  # [ep, (rows, copies)]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        # Everything below that needs no host count is queued before the one sync, so the GPU has it.
        sent = to_rank.reshape(-1)  # rank-major, then token: the send order
        send_slots = torch.where(sent, sent.cumsum(0) - 1, -1).view(self.size, tokens).T.contiguous()
        local_ids = torch.where(on_rank, ids[None] - ranks[:, None, None] * local_experts, -1)
        rank_weights = torch.where(on_rank, weights[None], 0)  # each weight lands on exactly one rank
        order = torch.argsort((~sent).to(torch.uint8), stable=True)  # sent (rank, token) pairs first
        sent_counts, received_counts = torch.stack([send_counts, recv_counts]).cpu().tolist()  # the one sync
        send_splits = [rows for rows, _ in sent_counts]
        recv_splits = [rows for rows, _ in received_counts]
        num_sent, num_copies = sum(send_splits), sum(copies for _, copies in received_counts)
        order = order[:num_sent]
        send = permute_tokens(routed.hidden_states, send_slots, num_sent, backend=self.backend)
        # rows, their weights and their local ids in one message (int32 ids: half the bytes of int64)
        rows, recv_weights, recv_ids = packed_all_to_all(
            (send, rank_weights.reshape(-1, k)[order], local_ids.reshape(-1, k)[order].to(torch.int32)),
            recv_splits,
            send_splits,
            self.group,
        )
        recv_ids = recv_ids.long()
        # Expand to one row per local copy, grouped by local expert (absent slots sort into a last,
        # dropped group); within an expert, rows keep their arrival order (source rank, then token).
        grouped = expert_permutation(torch.where(recv_ids >= 0, recv_ids, local_experts), local_experts + 1)
        recv_slots = torch.where(recv_ids >= 0, grouped.slot_rows, -1)
        state = _DedupState(send_slots, recv_slots, recv_weights, send_splits, recv_splits)
        return DispatchedTokens(
            hidden_states=permute_tokens(rows, recv_slots, num_copies, backend=self.backend),
            tokens_per_expert=grouped.rows_per_expert[:local_experts],
            state=state,
        )

    def _combine_dedup(self, expert_outputs: torch.Tensor, state: _DedupState) -> torch.Tensor:
        # per received row: Σ over its local copies of weight · expert output, one row back per (token, rank)
        partial = combine_tokens(
            expert_outputs, state.recv_slots, weights=state.recv_weights, backend=self.backend
        )
        back = all_to_all(partial, state.send_splits, state.recv_splits, self.group)
        return combine_tokens(back, state.send_slots, backend=self.backend)  # Σ over ≤ ep ranks

    # -- one row per (token, expert) copy ----------------------------------------------------------------

    def _copy_counts(
        self, routed: RoutedTokens, *, functional: bool = False
    ) -> tuple[ExpertPermutation, torch.Tensor]:
        """The copies sorted by global expert, and the copies each source rank sends to this rank's local
        experts ([src rank · local expert], exchanged on the device; through the functional collective
        where the exchange is traced)."""
        perm = expert_permutation(routed.topk_ids, routed.num_experts)
        if functional:
            return perm, funcol.all_to_all_single(perm.rows_per_expert, None, None, self.group)
        recv_counts = torch.empty_like(perm.rows_per_expert)
        dist.all_to_all_single(recv_counts, perm.rows_per_expert, group=self.group)
        return perm, recv_counts

    def _dispatch_copies(self, routed: RoutedTokens, capacity: ExchangeCapacity | None) -> DispatchedTokens:
        local_experts = routed.local_experts(self.size)
        perm, recv_counts = self._copy_counts(routed)
        send = permute_tokens(routed.hidden_states, perm.slot_rows, perm.num_rows, backend=self.backend)
        send_counts = perm.rows_per_expert
        counts = torch.stack([send_counts, recv_counts]).view(2, self.size, local_experts).sum(2)
        if capacity is not None:  # not calibrated yet: the loads it will be sized from
            capacity.record(counts[0], None)
        send_splits, recv_splits = counts.cpu().tolist()  # the one sync
        rows = all_to_all(send, recv_splits, send_splits, self.group)
        num_received = sum(recv_splits)
        # Received grouped by (source, local expert): regrouped by local expert. The permute kernel moves the
        # rows (its backward a gather): an index `rows[order]` had a backward of atomic index-adds, ~11 ms of
        # an FSDP 4 × EP 4 step on H200.
        grouped = block_regroup(
            recv_counts.view(1, self.size, local_experts), num_received, backend=self.backend
        )
        state = _CopyState(
            perm.slot_rows, routed.topk_weights, grouped.slot_rows, send_splits, recv_splits, static=False
        )
        hidden = permute_tokens(rows, grouped.slot_rows, num_received, backend=self.backend)
        return DispatchedTokens(hidden_states=hidden, tokens_per_expert=grouped.rows_per_expert, state=state)

    def _dispatch_copies_capacity(self, routed: RoutedTokens, capacity: ExchangeCapacity) -> DispatchedTokens:
        """The copy exchange with `capacity.rows[s][d]` rows from rank s to rank d: split sizes the host knows
        without reading the counts, so nothing here synchronizes (capacity.py). Each peer's segment holds its
        copies grouped by local expert, then zero rows; copies past the pair's rows are not sent (an
        overflow, recorded for the training loop, which reruns the step).

        Traceable: its collectives are functional ones (`funcol`), whose waits inductor schedules, so a
        compiled MoE block keeps routing, this exchange, the experts and the combine in one graph. The
        capacity's ints reach dynamo as symbols (`ExchangeCapacity.set_rows`), so every layer and every
        later capacity reuse one graph."""
        local_experts = routed.local_experts(self.size)
        perm, recv_counts = self._copy_counts(routed, functional=True)
        per_peer = perm.rows_per_expert.view(self.size, local_experts).sum(1)
        (sent_rows, sent_start), (recv_rows, recv_start) = capacity.splits_on(per_peer.device)
        capacity.record(per_peer, sent_rows)
        send_splits, recv_splits = capacity.send_splits(), capacity.recv_splits()
        # Expert-sorted row → (peer, offset within the peer's copies) → row of the peer's segment.
        peer = routed.topk_ids // local_experts
        offset = perm.slot_rows - (per_peer.cumsum(0) - per_peer)[peer]
        slot_rows = torch.where(offset < sent_rows[peer], sent_start[peer] + offset, -1)
        send = permute_tokens(routed.hidden_states, slot_rows, sum(send_splits), backend=self.backend)
        rows = funcol.all_to_all_single_autograd(send, recv_splits, send_splits, self.group)
        # Local expert of each received row: source s's segment holds its copies for local expert e at
        # offsets [cum[s, e-1], cum[s, e]); offsets past its last copy are padding (group `local_experts`,
        # after every expert's rows, which the grouped matmul leaves out).
        num_received = sum(recv_splits)
        device = recv_counts.device
        cum = recv_counts.view(self.size, local_experts).cumsum(1)
        source = torch.repeat_interleave(  # output_size given: no host sync
            torch.arange(self.size, device=device), recv_rows, output_size=num_received
        )
        offsets = torch.arange(num_received, device=device) - recv_start[source]
        expert_of_row = (cum[source] <= offsets[:, None]).sum(1)  # experts whose rows end at or before it
        grouped = expert_permutation(expert_of_row[:, None], local_experts + 1)
        state = _CopyState(
            slot_rows, routed.topk_weights, grouped.slot_rows, send_splits, recv_splits, static=True
        )
        hidden = permute_tokens(rows, grouped.slot_rows, num_received, backend=self.backend)
        return DispatchedTokens(
            hidden_states=hidden, tokens_per_expert=grouped.rows_per_expert[:local_experts], state=state
        )

    def _combine_copies(self, expert_outputs: torch.Tensor, state: _CopyState) -> torch.Tensor:
        received_order = combine_tokens(expert_outputs, state.regroup, backend=self.backend)  # a gather
        if state.static:
            back = funcol.all_to_all_single_autograd(
                received_order, state.send_splits, state.recv_splits, self.group
            )
        else:
            back = all_to_all(received_order, state.send_splits, state.recv_splits, self.group)
        return combine_tokens(back, state.slot_rows, weights=state.weights, backend=self.backend)

    # -- the copy exchange in chunks, their transfers overlapping the experts --------------------------------

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _exchange_overlapped(
        self, routed: RoutedTokens, experts: ExpertsFn, shared: SharedFn | None
    ) -> torch.Tensor:
        """The copy exchange on `overlap_chunks` contiguous chunks of the tokens. One all-to-all of every
        chunk's counts and one host read of their split sizes, then every chunk's rows are launched; the
        shared expert runs while the first chunk's rows travel, chunk c's experts while chunk c + 1's rows
        travel, and chunk c's results travel back while chunk c + 1's experts run. In backward the same
        (`overlap.py`): each gradient travels while other work computes. Exposed: the first chunk's dispatch
        (without a shared expert) and the last chunk's combine. Each chunk's result equals the copy
        exchange's for those tokens (the same rows meet the same experts; a grouped matmul over fewer rows
        may tile them differently on GPUs).

        Eager as a whole (the in-flight handles are Python objects), so inside a compiled block the experts
        run eagerly here (their activation one fused kernel, `GroupedExperts`)."""
        local_experts = routed.local_experts(self.size)
        chunks, num_experts = self.overlap_chunks, routed.num_experts
        hidden, ids = routed.hidden_states, routed.topk_ids
        k = ids.shape[1]
        tokens = [t.shape[0] for t in hidden.tensor_split(chunks)]  # host-known chunk sizes
        # Every chunk's index work in one pass, not one per chunk (on a host-bound step each pass is a dozen
        # launches): the copies sorted by (chunk, global expert) are each chunk's copy-exchange order, side by
        # side, so one permutation and one permute give every chunk's send rows as a slice.
        keys = torch.cat(
            [chunk_ids + c * num_experts for c, chunk_ids in enumerate(ids.tensor_split(chunks))]
        )
        perm = expert_permutation(keys, chunks * num_experts)
        send = permute_tokens(hidden, perm.slot_rows, perm.num_rows, backend=self.backend)
        # [peer, chunk, local expert]: what this rank sends each peer; the reply, what each source sends it
        send_counts = perm.rows_per_expert.view(chunks, self.size, local_experts).transpose(0, 1).contiguous()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        # [(sent, received), chunk, peer]: the one sync
        splits = torch.stack([send_counts.sum(2), recv_counts.sum(2)]).transpose(1, 2).cpu().tolist()
        sent = [sum(s) for s in splits[0]]
        received = [sum(r) for r in splits[1]]
        outbound = [
            launch(rows, recv_splits, send_splits, self.group)
            for rows, send_splits, recv_splits in zip(send.split(sent), *splits, strict=True)
        ]
        # where each chunk's received rows go when regrouped by local expert: one pass over all chunks
        regroup = block_regroup(recv_counts.transpose(0, 1), sum(received), backend=self.backend)
        per_expert = regroup.rows_per_expert.view(chunks, local_experts)
        alongside = None if shared is None else shared()
        inbound = []
        for c, ((rows, flight), send_splits, recv_splits, first) in enumerate(
            zip(outbound, *splits, _starts(received), strict=True)
        ):
            # chunk c's rows sort among themselves (its groups come before chunk c + 1's): local rows
            slot_rows = regroup.slot_rows[first : first + received[c]] - first
            grouped = permute_tokens(land(rows, flight), slot_rows, received[c], backend=self.backend)
            expert_out = experts(grouped, per_expert[c])
            received_order = combine_tokens(expert_out, slot_rows, backend=self.backend)  # a gather
            inbound.append(launch(received_order, send_splits, recv_splits, self.group))
        # each chunk's copies are a slice of the send order: its tokens' slots, less the rows before it
        slots = perm.slot_rows.split(tokens)
        weights = routed.topk_weights.split(tokens)
        out = torch.cat(
            [
                combine_tokens(land(rows, flight), slot_rows - k * first, weights=w, backend=self.backend)
                for (rows, flight), slot_rows, w, first in zip(
                    inbound, slots, weights, _starts(tokens), strict=True
                )
            ]
        )
        return out if alongside is None else out + alongside


def _starts(sizes: list[int]) -> list[int]:
    """The offset of each of consecutive blocks of `sizes`."""
    return [sum(sizes[:i]) for i in range(len(sizes))]
