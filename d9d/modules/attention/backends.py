"""Scaled-dot-product attention kernels behind one call signature, chosen by capability or override."""

from __future__ import annotations

import importlib.util
import os
from typing import Literal, Protocol, get_args

import torch
import torch.nn.functional as F

from d9d.modules.attention.mask import AttentionMask

SdpaBackendName = Literal["auto", "torch", "eager", "flash_attn"]
ATTENTION_BACKEND_ENV = "D9D_ATTENTION_BACKEND"


class SdpaBackend(Protocol):
    """q [batch, q_heads, seq, dim], k/v [batch, kv_heads, seq, dim] → [batch, q_heads, seq, dim]."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: AttentionMask,
        window: int | None,
        scale: float,
    ) -> torch.Tensor: ...


class TorchSdpa:
    """`F.scaled_dot_product_attention`. A plain causal pattern uses `is_causal` so the flash kernel runs
    (with native GQA); with an explicit mask, k/v are expanded to the query heads first because the
    memory-efficient kernel, the one that takes masks, has no GQA support and would fall back to math."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: AttentionMask,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if mask.is_plain_causal and window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        if gqa:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        dense = mask.dense(q.shape[2], window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)


class EagerSdpa:
    """The reference: explicit scores, float32 softmax. Slow and memory-hungry; for tests and debugging."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: AttentionMask,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask.dense(q.shape[2], window, q.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)


class FlashAttnSdpa:
    """The `flash_attn` package's kernel: causal (optionally windowed) attention without padding/segments."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: AttentionMask,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        if not mask.is_plain_causal:
            raise ValueError(
                "attention backend 'flash_attn' supports plain causal masks only; this batch has padding or "
                "segment ids: use backend 'torch' (or 'auto', which falls back per batch)"
            )
        from flash_attn import flash_attn_func

        out = flash_attn_func(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            softmax_scale=scale,
            causal=True,
            window_size=(window - 1, 0) if window is not None else (-1, -1),
        )
        return out.transpose(1, 2)  # type: ignore[no-any-return]  # flash_attn is untyped


def flash_attn_usable(q: torch.Tensor, mask: AttentionMask) -> bool:
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and mask.is_plain_causal
        and importlib.util.find_spec("flash_attn") is not None
    )


class AutoSdpa:
    """Per call: `flash_attn` when installed and applicable (CUDA, half precision, plain causal), else
    torch."""

    def __init__(self) -> None:
        self._torch = TorchSdpa()
        self._flash = FlashAttnSdpa()

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: AttentionMask,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        backend: SdpaBackend = self._flash if flash_attn_usable(q, mask) else self._torch
        return backend(q, k, v, mask=mask, window=window, scale=scale)


def build_sdpa_backend(name: SdpaBackendName = "auto") -> SdpaBackend:
    """Resolves a backend name; `auto` honours the `D9D_ATTENTION_BACKEND` environment override first."""
    if name == "auto":
        override = os.environ.get(ATTENTION_BACKEND_ENV, "auto")
        if override not in get_args(SdpaBackendName):
            raise ValueError(
                f"{ATTENTION_BACKEND_ENV}={override!r} is not one of {list(get_args(SdpaBackendName))}"
            )
        name = override  # type: ignore[assignment]  # validated just above
    if name == "torch":
        return TorchSdpa()
    if name == "eager":
        return EagerSdpa()
    if name == "flash_attn":
        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError(
                "attention backend 'flash_attn' requested but the flash_attn package is not installed"
            )
        return FlashAttnSdpa()
    return AutoSdpa()
