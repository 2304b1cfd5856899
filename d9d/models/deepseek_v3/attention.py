"""Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value projections, and a rotary key
shared by all heads beside each head's position-free key ("decoupled RoPE")."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.backend import KernelBackend
from d9d.modules.attention import AttentionMask, SdpaBackend, SdpaCall
from d9d.modules.attention.backends import TorchSdpa
from d9d.modules.norm import RMSNorm
from d9d.modules.rotary import RotaryTables


class SharedRopeKey(nn.Identity):
    """Where the one rotary key enters every head. A tensor-parallel plan, which splits the heads, sums its
    gradient over the ranks here (each rank's heads contribute a part of it)."""


class MultiHeadLatentAttention(nn.Module):
    """`x` [batch, seq, hidden] → same shape.

    - queries: `q_proj` (`q_lora_rank` None), or `q_b_proj(q_a_layernorm(q_a_proj(x)))`;
      [heads, qk_nope_head_dim + qk_rope_head_dim] each.
    - keys/values: `kv_a_proj_with_mqa(x)` gives a `kv_lora_rank` latent and one `qk_rope_head_dim` rotary
      key; `kv_b_proj(kv_a_layernorm(latent))` expands the latent to each head's position-free key and value.
    - the rotary parts of queries and the shared key are rotated (the tables' style: interleaved pairs or
      halves), the shared key is broadcast to every head, and attention runs on `backend` with `scale`.

    Head counts are derived from projection outputs, so a tensor-parallel plan can column-split `q_b_proj` /
    `q_proj` / `kv_b_proj` and row-split `o_proj`. Parameter names are Hugging Face's `DeepseekV3Attention`'s.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        bias: bool = False,
        norm_eps: float = 1e-6,
        backend: SdpaBackend | None = None,
        init_std: float = 0.02,
        output_init_std: float | None = None,
        norm_backend: KernelBackend = "auto",
    ) -> None:
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.backend: SdpaBackend = backend if backend is not None else TorchSdpa()
        self.init_std = init_std
        self.output_init_std = output_init_std if output_init_std is not None else init_std
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, backend=norm_backend)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps, backend=norm_backend)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.rope_key = SharedRopeKey()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj in (
            self.q_proj,
            self.q_a_proj,
            self.q_b_proj,
            self.kv_a_proj_with_mqa,
            self.kv_b_proj,
            self.o_proj,
        ):
            if proj is None:
                continue
            nn.init.normal_(proj.weight, std=self.output_init_std if proj is self.o_proj else self.init_std)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        for norm in (self.q_a_layernorm, self.kv_a_layernorm):
            if norm is not None:
                norm.reset_parameters()

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            out: torch.Tensor = self.q_proj(x)
            return out
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        out = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return out

    def forward(self, x: torch.Tensor, rotary: RotaryTables, mask: AttentionMask) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self._queries(x).view(batch, seq, -1, self.nope_dim + self.rope_dim)
        q_pass, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, -1, self.nope_dim + self.v_dim)
        k_pass, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rot = self.rope_key(k_rot).view(batch, seq, 1, self.rope_dim)
        q_rot, k_rot = rotary.apply_qk(q_rot, k_rot)
        heads = q.shape[2]
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(batch, seq, heads, self.rope_dim)), dim=-1)
        out = self.backend(
            SdpaCall(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                mask=mask,
                window=None,
                scale=self.scale,
            )
        )
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        return projected
