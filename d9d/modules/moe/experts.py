"""The routed experts of an MoE layer as stacked SwiGLU weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from d9d.kernels.swiglu import swiglu
from d9d.modules.moe.grouped_mm import GroupedMM, build_grouped_mm


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts stored as [experts, in, out] tensors: `gate_up_proj`
    [E, hidden, 2 · intermediate] (the gate projection in the first `intermediate` output columns, the up
    projection in the last) and `down_proj` [E, intermediate, hidden]. Gate and up run as one grouped
    matmul, so their backward is one grouped matmul too and yields the input gradient without summing two
    of them. Under expert parallelism the leading dim is sharded, so forward works on whatever number of
    (local) experts the parameters hold."""

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
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # gate and up share one std, so drawing the fused tensor at once is the same as drawing each half
        nn.init.normal_(self.gate_up_proj, std=self.init_std)
        nn.init.normal_(self.down_proj, std=self.output_init_std)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """`x` [rows, hidden] grouped by expert with `tokens_per_expert` rows each → [rows, hidden]."""
        gate, up = self.grouped_mm(x, self.gate_up_proj, tokens_per_expert).chunk(2, dim=-1)
        if torch.compiler.is_compiling():
            act = F.silu(gate) * up  # inductor fuses it with the split and, in backward, the concatenation
        else:  # eagerly (an overlapped exchange runs the experts outside the compiled block): one kernel
            act = swiglu(gate, up)
        return self.grouped_mm(act, self.down_proj, tokens_per_expert)

    def extra_repr(self) -> str:
        experts, intermediate, hidden = self.down_proj.shape
        return f"experts={experts}, hidden={hidden}, intermediate={intermediate}"
