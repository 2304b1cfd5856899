"""The routed experts of an MoE layer as stacked SwiGLU weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from d9d.modules.moe.grouped_mm import GroupedMM, build_grouped_mm


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts stored as [experts, in, out] tensors and run with one grouped matmul per
    projection. Under expert parallelism the leading dim is sharded, so forward works on whatever number
    of (local) experts the parameters hold."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        grouped_mm: GroupedMM | None = None,
        init_std: float = 0.02,
        output_init_std: float | None = None,
    ) -> None:
        super().__init__()
        self.grouped_mm: GroupedMM = grouped_mm if grouped_mm is not None else build_grouped_mm()
        self.init_std = init_std
        self.output_init_std = output_init_std if output_init_std is not None else init_std
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_proj, std=self.init_std)
        nn.init.normal_(self.up_proj, std=self.init_std)
        nn.init.normal_(self.down_proj, std=self.output_init_std)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """`x` [rows, hidden] grouped by expert with `tokens_per_expert` rows each → [rows, hidden]."""
        gate = self.grouped_mm(x, self.gate_proj, tokens_per_expert)
        up = self.grouped_mm(x, self.up_proj, tokens_per_expert)
        return self.grouped_mm(F.silu(gate) * up, self.down_proj, tokens_per_expert)

    def extra_repr(self) -> str:
        experts, hidden, intermediate = self.gate_proj.shape
        return f"experts={experts}, hidden={hidden}, intermediate={intermediate}"
