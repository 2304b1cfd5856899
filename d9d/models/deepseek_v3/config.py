"""DeepSeek-V3-style MoE hyper-parameters: multi-head latent attention, shared + routed experts with
sigmoid, group-limited routing and the auxiliary-loss-free expert bias, the first layers dense."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.kernels.backend import KernelBackend
from d9d.modules.attention import SdpaBackendName
from d9d.modules.moe import GroupedMMName
from d9d.modules.rotary import NoRopeScaling, YarnRopeScaling

DeepSeekRopeScaling = Annotated[NoRopeScaling | YarnRopeScaling, Field(discriminator="kind")]


class DeepSeekV3Config(BaseModel):
    """Everything that shapes a DeepSeek-V3-style model (field names follow d9d; `d9d.models.deepseek_v3.hf`
    converts Hugging Face's `DeepseekV3Config` both ways).

    Attention (MLA): queries from a low-rank `q_lora_rank` projection (None: one full projection), keys and
    values from one `kv_lora_rank` latent per token, each head's query/key split into `qk_nope_head_dim`
    position-free and `qk_rope_head_dim` rotary dims, the rotary key shared by all heads ("decoupled RoPE"),
    values of `v_head_dim`. `rope_interleave`: the rotary dims pair adjacent elements (DeepSeek's layout).

    Feed-forward: layers below `first_k_dense` are dense SwiGLUs of `intermediate_size`; the others are MoE
    layers of `num_experts` routed experts (`moe_intermediate_size`) plus `num_shared_experts` always-on
    experts (one SwiGLU of `num_shared_experts × moe_intermediate_size`). Routing: per-expert sigmoid
    scores; with `expert_bias` a per-expert bias (HF `e_score_correction_bias`) is added for selection only
    and updated after every optimizer step by `expert_bias_update_rate` towards balance (auxiliary-loss-
    free); experts come from the `topk_groups` best of `num_expert_groups` groups; the top-k weights are
    renormalized (`norm_topk_prob`) and scaled by `routed_scaling_factor`. `router_aux_loss_coef` adds d9d's
    switch-style balancing loss (DeepSeek-V3 relies on the bias; 0 by default).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(gt=0)
    vocab_splits: dict[str, int] | None = None
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    q_lora_rank: int | None = Field(None, gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    num_experts: int = Field(gt=0)
    num_shared_experts: int = Field(1, ge=0)
    num_experts_per_tok: int = Field(gt=0)
    num_expert_groups: int = Field(1, gt=0)
    topk_groups: int = Field(1, gt=0)
    routed_scaling_factor: float = Field(1.0, gt=0)
    norm_topk_prob: bool = True
    first_k_dense: int = Field(0, ge=0)
    expert_bias: bool = True
    expert_bias_update_rate: float = Field(1e-3, ge=0)
    router_aux_loss_coef: float = Field(0.0, ge=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    rope_theta: float = Field(10_000.0, gt=0)
    rope_scaling: DeepSeekRopeScaling = Field(default_factory=NoRopeScaling)
    rope_interleave: bool = True
    max_position_embeddings: int = Field(4096, gt=0)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = Field(0.02, gt=0)
    attention_backend: SdpaBackendName = "auto"
    loss_chunk_size: int = Field(2048, gt=0)
    kernel_backend: KernelBackend = "auto"
    grouped_mm: GroupedMMName = "auto"
    moe_kernels: KernelBackend = "auto"
    moe_row_align: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> DeepSeekV3Config:
        if self.num_experts % self.num_expert_groups:
            raise ValueError(
                f"num_experts={self.num_experts} does not split into "
                f"num_expert_groups={self.num_expert_groups}"
            )
        per_group = self.num_experts // self.num_expert_groups
        if (
            self.topk_groups > self.num_expert_groups
            or self.topk_groups * per_group < self.num_experts_per_tok
        ):
            raise ValueError(
                f"topk_groups={self.topk_groups} of {self.num_expert_groups} groups of {per_group} experts "
                f"cannot hold num_experts_per_tok={self.num_experts_per_tok}"
            )
        if self.first_k_dense > self.num_layers:
            raise ValueError(f"first_k_dense={self.first_k_dense} exceeds num_layers={self.num_layers}")
        if self.vocab_splits is not None and sum(self.vocab_splits.values()) != self.vocab_size:
            raise ValueError(
                f"vocab_splits {self.vocab_splits} sum to {sum(self.vocab_splits.values())}, "
                f"not vocab_size={self.vocab_size}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        return self

    @property
    def splits(self) -> dict[str, int]:
        return dict(self.vocab_splits) if self.vocab_splits is not None else {"regular": self.vocab_size}

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def output_init_std(self) -> float:
        return self.initializer_range / math.sqrt(2 * self.num_layers)

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-1/2, times mscale² under YaRN with `mscale_all_dim` (DeepSeek's long-context
        attention temperature)."""
        scale: float = self.qk_head_dim**-0.5
        scaling = self.rope_scaling
        if isinstance(scaling, YarnRopeScaling) and scaling.mscale_all_dim and scaling.factor > 1:
            mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
            scale *= mscale * mscale
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense
