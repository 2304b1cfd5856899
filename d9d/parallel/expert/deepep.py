"""Expert-parallel token exchange through DeepEP's NVLink kernels (CUDA only, bf16 activations).

DeepEP sends each token once to every rank hosting at least one of its experts (not once per expert),
with the routing of that token translated to local expert ids (-1 for experts elsewhere, whose weight
arrives as 0). This handler expands the received tokens into one row per (token, local expert) grouped by
expert, and on the way back sums a token's rows locally before DeepEP's combine sums across ranks. DeepEP
kernels are not differentiable, so both directions are wrapped: the backward of dispatch is a combine and
the backward of combine is a cached-layout dispatch (the handle of the forward dispatch).

The API used is `deep_ep.Buffer`'s normal (high-throughput) intranode mode: `deep_ep/buffer.py` in DeepEP
V1 (last V1 commit 567632d), `deep_ep/buffers/legacy.py` in V2 (checked at dd758ca), the same signatures in
both. Intranode only: DeepEP instantiates those kernels for groups of 2, 4 or 8 ranks on one NVLink domain;
larger groups go through its internode (NVSHMEM / RDMA) kernels, which this handler does not drive.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from d9d.kernels.backend import KernelBackend
from d9d.kernels.moe import combine_tokens, expert_permutation, permute_tokens
from d9d.modules.moe.communication import (
    DispatchedTokens,
    ExpertsFn,
    RoutedTokens,
    SharedFn,
    sequential_exchange,
)

_log = logging.getLogger(__name__)

# The group sizes DeepEP's intranode kernels are compiled for (`SWITCH_RANKS`, csrc/kernels/legacy/launch.cuh
# at dd758ca; csrc/kernels/launch.cuh in V1); any other size fails a host assert inside the C++ extension.
INTRANODE_GROUP_SIZES = (2, 4, 8)

# The intranode dispatch stages half a token row per warp in 8192 bytes of shared memory (TMA, sm_90 builds;
# `kNumTMABytesPerWarp` in csrc/kernels/legacy/intranode.cu at dd758ca, same in V1) behind an 8-byte
# mbarrier, and needs an even number of 16-byte vectors per row: a row of at most 16352 bytes, a multiple of
# 32. Past that a device-side assert kills the CUDA context, so the limit is checked on the host.
_ROW_BYTES_MULTIPLE = 32
_MAX_ROW_BYTES = 2 * ((8192 - 8) // 16) * 16


def deep_ep_available() -> bool:
    """Whether `deep_ep` can be imported here (it is an optional, CUDA-only dependency). V2's `__init__`
    also checks, at import, that the NCCL torch loaded is the one DeepEP was linked against and starts its
    kernel JIT: a failure there (an assertion or a runtime error, not an ImportError) means unusable too."""
    try:
        importlib.import_module("deep_ep")
    except ImportError:
        return False
    except (AssertionError, RuntimeError, OSError) as e:
        _warn_import_failed(repr(e))
        return False
    return True


@functools.cache
def _warn_import_failed(error: str) -> None:
    """Once per process and error, not once per MoE layer."""
    _log.warning("deep_ep is installed but its import failed: %s", error)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        buffer: Any,
        num_experts: int,
        dispatch_config: Any,
        combine_config: Any,
        handle_out: list[Any],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Synchronous (async_finish=False): the current stream waits for DeepEP's communication stream, so the
        # outputs are ready for the ops queued after this call and no EventOverlap has to be kept.
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_ids, num_experts)
        # Returns (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event);
        # the list is on the host already (DeepEP waited for the counts), so the rows' layout needs no sync.
        recv_x, recv_ids, recv_weights, per_expert, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_ids,
            topk_weights=topk_weights,
            config=dispatch_config,
        )
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.combine_config = combine_config
        handle_out.extend((handle, per_expert))
        ctx.mark_non_differentiable(recv_ids)
        return recv_x, recv_weights, recv_ids

    @staticmethod
    def backward(
        ctx: Any, grad_x: torch.Tensor, grad_weights: torch.Tensor, _grad_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        # A combine sums each token's gradient rows over the ranks it went to; its `topk_weights` (float32,
        # [received, k]) come back summed the same way, and as a slot's weight lives on one rank only (0 on
        # the others), that sum is the slot's gradient.
        x, weights, _ = ctx.buffer.combine(
            grad_x.contiguous(),
            ctx.handle,
            topk_weights=grad_weights.contiguous(),
            config=ctx.combine_config,
        )
        return x, weights, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, buffer: Any, handle: Any, dispatch_config: Any, combine_config: Any
    ) -> torch.Tensor:
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.dispatch_config = dispatch_config
        # Returns (combined_x, combined_topk_weights or None, event).
        out, _, _ = buffer.combine(x.contiguous(), handle, config=combine_config)
        return out  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # The cached-layout dispatch: the forward dispatch's handle instead of a layout, no top-k; it returns
        # (recv_x, None, None, None, None, event). It must run with the dispatch config's SM count, as the
        # handle's channel prefix matrix has one column per channel (two SMs).
        grad_x, _, _, _, _, _ = ctx.buffer.dispatch(
            grad.contiguous(), handle=ctx.handle, config=ctx.dispatch_config
        )
        return grad_x, None, None, None, None


@dataclass(frozen=True)
class _DeepEPState:
    buffer: Any  # the buffer the dispatch ran on: combine must use it (and its handle) too
    handle: Any
    configs: tuple[Any, Any]  # (dispatch, combine) configs of that dispatch
    recv_slots: torch.Tensor  # [received tokens, k]: expert-grouped row of each local copy, -1 elsewhere
    recv_weights: torch.Tensor  # [received tokens, k]: routing weights that came with the tokens, 0 elsewhere


class DeepEPMoECommunication:
    """`MoECommunication` over DeepEP's normal (high-throughput) intranode kernels. The buffer is sized
    lazily for the hidden size of the first dispatch and grown when a larger one arrives (a collective:
    every rank of the group sees the same hidden size, so they grow together); `close` releases them.

    `num_sms`: SMs for DeepEP's kernels (even; DeepEP's default is 20). `Buffer.set_num_sms` is a class-wide
    setting read by DeepEP's config getters, so this handler captures its dispatch and combine configs once
    (at the first dispatch) and passes them to every call: the buffer size, the forward calls and the
    backward calls then agree on the SM count whatever another handler sets later."""

    def __init__(
        self, group: dist.ProcessGroup, *, num_sms: int | None = None, backend: KernelBackend = "auto"
    ) -> None:
        self._deep_ep = importlib.import_module("deep_ep")
        self.group = group
        self.backend: KernelBackend = backend
        self.size = dist.get_world_size(group)
        if self.size not in INTRANODE_GROUP_SIZES:
            raise ValueError(
                f"DeepEP's intranode kernels serve expert-parallel groups of {INTRANODE_GROUP_SIZES} ranks, "
                f"got {self.size}; use the all_to_all expert-parallel backend"
            )
        if num_sms is not None:
            self._deep_ep.Buffer.set_num_sms(num_sms)
        self._configs: tuple[Any, Any] | None = None
        self._buffer: Any = None
        self._buffers: list[Any] = []  # every buffer made (an outgrown one may still serve a backward)

    def _buffer_for(self, hidden_bytes: int) -> tuple[Any, Any, Any]:
        """(buffer, dispatch config, combine config) for rows of `hidden_bytes`."""
        buffer_cls = self._deep_ep.Buffer
        if self._configs is None:
            self._configs = (
                buffer_cls.get_dispatch_config(self.size),
                buffer_cls.get_combine_config(self.size),
            )
        nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, self.size) for config in self._configs)
        current = self._buffer
        if current is None or current.num_nvl_bytes < nvl:
            # No RDMA bytes: within one node (the group sizes above) DeepEP's RDMA hint is 0, and a build
            # without NVSHMEM (the intranode-only one, deploy/device/build_deep_ep.sh) asserts when asked.
            # Destroyed explicitly (`close`), at a point every rank reaches together: DeepEP's implicit
            # destruction runs a GPU barrier over the group from the garbage collector, and a rank whose peers
            # already exited waits in it forever (a 4-GPU run finished its steps, then hung at exit).
            self._buffer = buffer_cls(self.group, nvl, 0, explicitly_destroy=True)
            self._buffers.append(self._buffer)
        return self._buffer, *self._configs

    def close(self) -> None:
        """Release DeepEP's buffers (a barrier over the group: every rank calls this at the same point, e.g.
        at the end of training). The handler can dispatch again afterwards; it makes a new buffer."""
        buffers, self._buffers, self._buffer = self._buffers, [], None
        for buffer in buffers:
            buffer.destroy()

    # Eager even inside a compiled MoE block, as the all-to-all handler: the dispatch waits on the host for
    # the received counts, and the buffer, handle and configs are opaque C++ objects dynamo cannot trace.
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def dispatch(self, routed: RoutedTokens) -> DispatchedTokens:
        hidden_states = routed.hidden_states
        if hidden_states.dtype != torch.bfloat16:
            raise TypeError(
                f"DeepEP dispatch needs bfloat16 activations, got {hidden_states.dtype}; use the all_to_all "
                "expert-parallel backend for other dtypes"
            )
        row_bytes = hidden_states.shape[1] * hidden_states.element_size()
        if row_bytes % _ROW_BYTES_MULTIPLE or row_bytes > _MAX_ROW_BYTES:
            raise ValueError(
                f"DeepEP's intranode dispatch needs a token row of at most {_MAX_ROW_BYTES} bytes, a "
                f"multiple of {_ROW_BYTES_MULTIPLE} (bf16: hidden size a multiple of 16, at most "
                f"{_MAX_ROW_BYTES // 2}); got hidden size {hidden_states.shape[1]}"
            )
        local_experts = routed.local_experts(self.size)
        buffer, dispatch_config, combine_config = self._buffer_for(row_bytes)
        handles: list[Any] = []
        # DeepEP reads top-k ids as its build's `topk_idx_t` (int64 unless built with EP_NUM_TOPK_IDX_BITS=32)
        # and weights as float32, both contiguous [tokens, k].
        recv_x, recv_weights, recv_ids = _Dispatch.apply(
            hidden_states.contiguous(),
            routed.topk_weights.float().contiguous(),
            routed.topk_ids.to(self._deep_ep.topk_idx_t).contiguous(),
            buffer,
            routed.num_experts,
            dispatch_config,
            combine_config,
            handles,
        )
        handle, per_expert = handles
        # One row per (received token, local expert), grouped by expert (absent slots sort into a last,
        # dropped group) by the permute kernels, as the deduplicated all-to-all's receiver does (its
        # backward a gather, no atomics); the row count is DeepEP's host list, so nothing here syncs.
        recv_ids = recv_ids.long()
        grouped = expert_permutation(torch.where(recv_ids >= 0, recv_ids, local_experts), local_experts + 1)
        recv_slots = torch.where(recv_ids >= 0, grouped.slot_rows, -1)
        state = _DeepEPState(buffer, handle, (dispatch_config, combine_config), recv_slots, recv_weights)
        return DispatchedTokens(
            hidden_states=permute_tokens(recv_x, recv_slots, sum(per_expert), backend=self.backend),
            tokens_per_expert=grouped.rows_per_expert[:local_experts],
            state=state,
        )

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def combine(self, expert_outputs: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        state: _DeepEPState = dispatched.state
        # per received token: Σ over its local copies of weight · expert output (a gather per token)
        per_token = combine_tokens(
            expert_outputs, state.recv_slots, weights=state.recv_weights, backend=self.backend
        )
        out: torch.Tensor = _Combine.apply(
            per_token.to(torch.bfloat16), state.buffer, state.handle, *state.configs
        )
        return out.to(expert_outputs.dtype)

    def exchange(
        self, routed: RoutedTokens, experts: ExpertsFn, shared: SharedFn | None = None
    ) -> torch.Tensor:
        return sequential_exchange(self, routed, experts, shared)
