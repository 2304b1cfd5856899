"""Grouped-query self-attention with optional per-head q/k RMSNorm (Qwen3)."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.backend import KernelBackend
from d9d.modules.attention.backends import SdpaBackend, SdpaCall, TorchSdpa
from d9d.modules.attention.mask import AttentionMask
from d9d.modules.norm import RMSNorm
from d9d.modules.rotary import RotaryTables


class GroupedQueryAttention(nn.Module):
    """Self-attention where `num_heads` query heads share `num_kv_heads` key/value heads.

    The head counts are only used to size the projections: forward derives the number of (local) heads from
    the projection outputs, so tensor parallelism can column-shard q/k/v and row-shard o without this
    module knowing. `qk_norm` normalizes each head's q and k over `head_dim` before RoPE.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool = True,
        norm_eps: float = 1e-6,
        bias: bool = False,
        sliding_window: int | None = None,
        backend: SdpaBackend | None = None,
        init_std: float = 0.02,
        output_init_std: float | None = None,
        norm_backend: KernelBackend = "auto",
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.backend: SdpaBackend = backend if backend is not None else TorchSdpa()
        self.init_std = init_std
        self.output_init_std = output_init_std if output_init_std is not None else init_std
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, norm_eps, backend=norm_backend) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps, backend=norm_backend) if qk_norm else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj, std in (
            (self.q_proj, self.init_std),
            (self.k_proj, self.init_std),
            (self.v_proj, self.init_std),
            (self.o_proj, self.output_init_std),
        ):
            nn.init.normal_(proj.weight, std=std)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x` [batch, seq, hidden] → q, k, v [batch, seq, (local) heads, head_dim]."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, rotary: RotaryTables, mask: AttentionMask) -> torch.Tensor:
        """`x` [batch, seq, hidden] → [batch, seq, hidden]."""
        batch, seq, _ = x.shape
        q, k, v = self.project_qkv(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary.apply_qk(q, k)
        out = self.backend(
            SdpaCall(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                mask=mask,
                window=self.sliding_window,
                scale=self.scale,
            )
        )
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        return projected
