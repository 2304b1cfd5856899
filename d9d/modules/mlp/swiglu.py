"""The gated feed-forward block of Llama-family models."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.backend import KernelBackend
from d9d.kernels.swiglu import swiglu


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`; gate/up column-shard and down row-shards cleanly under TP.

    `backend` picks the fused Triton gate (`d9d.kernels.swiglu`) or the PyTorch reference; a plain
    attribute, so the owning model can set it after construction."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        init_std: float = 0.02,
        output_init_std: float | None = None,
        backend: KernelBackend = "auto",
    ) -> None:
        super().__init__()
        self.init_std = init_std
        self.backend: KernelBackend = backend
        self.output_init_std = output_init_std if output_init_std is not None else init_std
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_proj.weight, std=self.init_std)
        nn.init.normal_(self.up_proj.weight, std=self.init_std)
        nn.init.normal_(self.down_proj.weight, std=self.output_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), backend=self.backend))
        return out
