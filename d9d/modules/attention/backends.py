"""Scaled-dot-product attention kernels behind one call signature, chosen by capability or override.

Every backend takes one `SdpaCall` and has a `prepare` step: the model calls `prepare` once per forward,
before its layers, so whatever the kernel needs besides q/k/v (a dense boolean mask, FlexAttention block
masks) is built once, shared by all layers, and never built or cached inside a (compiled) layer.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, assert_never, get_args

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from d9d.modules.attention.mask import AttentionMask

SdpaBackendName = Literal["auto", "torch", "eager", "flex", "flash_attn"]
ATTENTION_BACKEND_ENV = "D9D_ATTENTION_BACKEND"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SdpaCall:
    """One attention call: q [batch, q_heads, seq, dim], k/v [batch, kv_heads, seq, dim] → like q."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: AttentionMask
    window: int | None
    scale: float

    @property
    def gqa(self) -> bool:
        return self.q.shape[1] != self.k.shape[1]

    @property
    def plain_causal(self) -> bool:
        """No window, no segments, no key padding: the causal kernel alone is exact."""
        return not self.mask.needs_mask(self.window)

    def repeated_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v expanded to the query heads, for kernels without grouped-query support."""
        groups = self.q.shape[1] // self.k.shape[1]
        return self.k.repeat_interleave(groups, dim=1), self.v.repeat_interleave(groups, dim=1)

    def dense_mask(self) -> torch.Tensor:
        return self.mask.dense(self.q.shape[2], self.window, self.q.device)


class SdpaBackend(Protocol):
    """An attention kernel: `prepare` once per forward (outside compiled regions), then one call per layer."""

    def prepare(
        self, mask: AttentionMask, *, seq_len: int, windows: Collection[int | None], device: torch.device
    ) -> AttentionMask: ...

    def __call__(self, call: SdpaCall) -> torch.Tensor: ...


def _with_dense(
    mask: AttentionMask, seq_len: int, windows: Collection[int | None], device: torch.device
) -> AttentionMask:
    dense = {w: mask.dense(seq_len, w, device) for w in windows if mask.needs_mask(w)}
    return replace(mask, dense_masks=dense)


def _with_blocks(
    mask: AttentionMask, seq_len: int, windows: Collection[int | None], device: torch.device
) -> AttentionMask:
    return replace(
        mask, block_masks={w: mask.block(seq_len, w, device) for w in windows if mask.needs_mask(w)}
    )


class TorchSdpa:
    """`F.scaled_dot_product_attention`. A plain causal pattern (including right padding) uses `is_causal`
    so the flash/cuDNN kernel runs with native GQA; anything else gets a dense mask with k/v expanded to the
    query heads, because the memory-efficient kernel, the one that takes masks, has no GQA support and
    would fall back to math. That dense path is the CPU path; on CUDA `auto` sends it to FlexAttention."""

    def prepare(
        self, mask: AttentionMask, *, seq_len: int, windows: Collection[int | None], device: torch.device
    ) -> AttentionMask:
        return _with_dense(mask, seq_len, windows, device)

    def __call__(self, call: SdpaCall) -> torch.Tensor:
        if call.plain_causal:
            return F.scaled_dot_product_attention(
                call.q, call.k, call.v, is_causal=True, scale=call.scale, enable_gqa=call.gqa
            )
        k, v = call.repeated_kv() if call.gqa else (call.k, call.v)
        return F.scaled_dot_product_attention(call.q, k, v, attn_mask=call.dense_mask(), scale=call.scale)


class EagerSdpa:
    """The reference: explicit scores, float32 softmax. Slow and memory-hungry; for tests and debugging."""

    def prepare(
        self, mask: AttentionMask, *, seq_len: int, windows: Collection[int | None], device: torch.device
    ) -> AttentionMask:
        return _with_dense(mask, seq_len, windows, device)

    def __call__(self, call: SdpaCall) -> torch.Tensor:
        k, v = call.repeated_kv()
        scores = torch.matmul(call.q, k.transpose(-1, -2)) * call.scale
        scores = scores.masked_fill(~call.dense_mask(), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(call.q.dtype)
        return torch.matmul(probs, v)


FLEX_MIN_HEAD_DIM = 16
"""CUDA FlexAttention's kernels refuse query/key or value heads narrower than this (torch 2.11: inductor's
"embedding dimension ... must be at least 16"), compiled or not."""


@functools.cache
def compiled_flex_attention() -> Callable[..., Any]:
    """`flex_attention` wrapped by `torch.compile` once per process (lazily: importing dynamo is slow)."""
    return torch.compile(flex_attention)


class FlexSdpa:
    """FlexAttention: documents, windows and padding as block masks — no S×S mask, no k/v repetition.

    On CUDA the kernel is `flex_attention` compiled once per process (uncompiled it materializes the full
    score matrix), picked up by the first `prepare`; inside an already compiled block dynamo traces straight
    through it. On CPU it runs the
    uncompiled reference, forward only (PyTorch has no FlexAttention backward on CPU), which is what the
    CPU tests compare against `EagerSdpa`.
    """

    def __init__(self) -> None:
        self._cuda_kernel: Callable[..., Any] | None = None

    def prepare(
        self, mask: AttentionMask, *, seq_len: int, windows: Collection[int | None], device: torch.device
    ) -> AttentionMask:
        if device.type == "cuda" and self._cuda_kernel is None:
            self._cuda_kernel = compiled_flex_attention()  # here, outside any compiled region
        return _with_blocks(mask, seq_len, windows, device)

    def __call__(self, call: SdpaCall) -> torch.Tensor:
        kernel: Callable[..., Any] = flex_attention
        if call.q.is_cuda:
            if not _flex_shapes(call):
                raise ValueError(
                    f"attention backend 'flex' on CUDA needs query/key and value heads of at least "
                    f"{FLEX_MIN_HEAD_DIM}, got {call.q.shape[-1]} and {call.v.shape[-1]}: use 'auto' (the "
                    "dense-mask SDPA for such heads) or 'torch'"
                )
            if self._cuda_kernel is not None:
                kernel = self._cuda_kernel
        block = call.mask.block(call.q.shape[2], call.window, call.q.device)
        out = kernel(call.q, call.k, call.v, block_mask=block, scale=call.scale, enable_gqa=call.gqa)
        assert isinstance(out, torch.Tensor)  # no lse/aux requested
        return out


class FlashAttnSdpa:
    """The `flash_attn` package's kernel: causal (optionally windowed) attention without padding/segments."""

    def prepare(
        self, mask: AttentionMask, *, seq_len: int, windows: Collection[int | None], device: torch.device
    ) -> AttentionMask:
        if not mask.is_plain_causal:
            raise ValueError(
                "attention backend 'flash_attn' supports plain causal masks only (right padding included); "
                "this batch has segment ids or non-right padding: use backend 'flex', 'torch' or 'auto'"
            )
        return mask

    def __call__(self, call: SdpaCall) -> torch.Tensor:
        if not _flash_shapes(call):
            raise ValueError(
                "attention backend 'flash_attn' needs equal query/key and value head dims (at most 256), got "
                f"{call.q.shape[-1]} and {call.v.shape[-1]} (e.g. multi-head latent attention): use 'auto', "
                "'torch' or 'flex'"
            )
        from flash_attn import flash_attn_func

        out = flash_attn_func(
            call.q.transpose(1, 2),
            call.k.transpose(1, 2),
            call.v.transpose(1, 2),
            softmax_scale=call.scale,
            causal=True,
            window_size=(call.window - 1, 0) if call.window is not None else (-1, -1),
        )
        return out.transpose(1, 2)  # type: ignore[no-any-return]  # flash_attn is untyped


def _flash_shapes(call: SdpaCall) -> bool:
    # flash_attn's kernels take one head dim for q, k and v (MLA's value heads are narrower than its query
    # heads) and at most 256.
    return call.q.shape[-1] == call.v.shape[-1] <= 256


def _flex_shapes(call: SdpaCall) -> bool:
    # what CUDA FlexAttention's kernels take (on CPU the uncompiled reference takes any head size)
    return min(call.q.shape[-1], call.v.shape[-1]) >= FLEX_MIN_HEAD_DIM


def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


class AutoSdpa:
    """The fastest exact kernel per call. CUDA: `flash_attn` for causal (and windowed causal) half-precision
    calls when installed, else SDPA `is_causal` with GQA for plain causal calls, FlexAttention for documents,
    windows and non-right padding. Elsewhere: `torch` (the dense-mask path for masked calls).

    The choice depends only on the mask's structure, the device and the dtype — never on tensor values — so
    it is fixed at trace time inside a compiled block. The policy is logged once per process and device.
    """

    def __init__(self) -> None:
        self._torch = TorchSdpa()
        self._flex = FlexSdpa()
        self._flash = FlashAttnSdpa()
        self._flash_installed = _flash_attn_installed()
        self._logged: set[str] = set()

    def _log_policy(self, device: torch.device) -> None:
        if device.type in self._logged:
            return
        self._logged.add(device.type)
        if device.type == "cuda":
            causal = "flash_attn (half precision)" if self._flash_installed else "SDPA is_causal + GQA"
            logger.info(
                "attention backend auto on cuda: plain causal batches (right padding included) → %s; "
                "documents, sliding windows, other padding → FlexAttention (compiled)",
                causal,
            )
        else:
            logger.info(
                "attention backend auto on %s: plain causal → SDPA is_causal + GQA; masked batches → SDPA "
                "with a dense mask (the reference path)",
                device.type,
            )

    def prepare(
        self, mask: AttentionMask, *, seq_len: int, windows: Collection[int | None], device: torch.device
    ) -> AttentionMask:
        self._log_policy(device)
        if device.type != "cuda":
            return self._torch.prepare(mask, seq_len=seq_len, windows=windows, device=device)
        return self._flex.prepare(mask, seq_len=seq_len, windows=windows, device=device)

    def __call__(self, call: SdpaCall) -> torch.Tensor:
        return self.backend_for(call, cuda=call.q.is_cuda)(call)

    def backend_for(self, call: SdpaCall, *, cuda: bool) -> SdpaBackend:
        if not cuda:
            return self._torch
        half = call.q.dtype in (torch.float16, torch.bfloat16)
        if self._flash_installed and half and call.mask.is_plain_causal and _flash_shapes(call):
            return self._flash
        if call.plain_causal:
            return self._torch
        if not _flex_shapes(call):
            # the dense mask, built per call (prepare made block masks): only models this small get here
            if "small heads" not in self._logged:
                self._logged.add("small heads")
                logger.info(
                    "attention backend auto on cuda: heads of %d/%d are below FlexAttention's minimum of %d: "
                    "masked batches use SDPA with a dense mask",
                    call.q.shape[-1],
                    call.v.shape[-1],
                    FLEX_MIN_HEAD_DIM,
                )
            return self._torch
        return self._flex


def build_sdpa_backend(name: SdpaBackendName = "auto") -> SdpaBackend:
    """Resolves a backend name; `auto` honours the `D9D_ATTENTION_BACKEND` environment override first."""
    if name == "auto":
        override = os.environ.get(ATTENTION_BACKEND_ENV, "auto")
        if override not in get_args(SdpaBackendName):
            raise ValueError(
                f"{ATTENTION_BACKEND_ENV}={override!r} is not one of {list(get_args(SdpaBackendName))}"
            )
        name = override  # type: ignore[assignment]  # validated just above
    match name:
        case "auto":
            return AutoSdpa()
        case "torch":
            return TorchSdpa()
        case "eager":
            return EagerSdpa()
        case "flex":
            return FlexSdpa()
        case "flash_attn":
            if not _flash_attn_installed():
                raise ValueError(
                    "attention backend 'flash_attn' requested but the flash_attn package is not installed"
                )
            return FlashAttnSdpa()
        case _:
            assert_never(name)
