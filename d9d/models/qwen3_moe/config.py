"""Qwen3-MoE hyper-parameters: Qwen3's plus the sparse feed-forward."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from d9d.kernels.backend import KernelBackend
from d9d.models.qwen3.config import Qwen3Config
from d9d.modules.moe import GroupedMMName


class Qwen3MoEConfig(Qwen3Config):
    """Layer i is sparse unless listed in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`
    (Hugging Face's rule); dense layers use `intermediate_size`, experts `moe_intermediate_size`.

    - `router_aux_loss_coef`: weight of the switch-style balancing loss, added through backward.
    - `expert_bias`: auxiliary-loss-free balancing; the engine calls `update_expert_bias()` on each router
      after every optimizer step, moving it by `expert_bias_update_rate`.
    - `grouped_mm`: expert matmul backend (`auto` picks by device; `D9D_GROUPED_MM` overrides auto).
    - `router_score_function`: `softmax` over experts (Qwen3-MoE) or per-expert `sigmoid` (DeepSeek-V3).
    - `moe_kernels`: token permute / combine kernels (`auto`: Triton on CUDA, PyTorch elsewhere).
    - `moe_row_align`: each expert's row group starts at a multiple of this (grouped-matmul tiles); the
      padding rows are zeros. Applies to the local (non expert-parallel) dispatch.
    """

    moe_intermediate_size: int = Field(gt=0)
    num_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = Field(1, gt=0)
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = Field(0.0, ge=0)
    expert_bias: bool = False
    expert_bias_update_rate: float = Field(1e-3, ge=0)
    grouped_mm: GroupedMMName = "auto"
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_kernels: KernelBackend = "auto"
    moe_row_align: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check_moe(self) -> Qwen3MoEConfig:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}"
            )
        return self

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
