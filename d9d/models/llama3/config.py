"""Llama 3 (3.0 – 3.3) dense architecture hyper-parameters."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.kernels.backend import KernelBackend
from d9d.models.llama3.rope import Llama3RopeScaling
from d9d.modules.attention import SdpaBackendName
from d9d.modules.rotary import (
    DynamicNTKRopeScaling,
    LinearRopeScaling,
    NoRopeScaling,
    YarnRopeScaling,
)

LlamaRopeScaling = Annotated[
    NoRopeScaling | Llama3RopeScaling | LinearRopeScaling | DynamicNTKRopeScaling | YarnRopeScaling,
    Field(discriminator="kind"),
]


class Llama3Config(BaseModel):
    """Everything that shapes a Llama 3 model. Field names follow d9d (as `Qwen3Config`), not Hugging Face;
    the family's format (`d9d.models.llama3.hf`) converts `config.json` both ways.

    - Grouped-query attention without q/k norms, SwiGLU, RMSNorm, RoPE in the "half" layout of Hugging Face
      checkpoints; `rope_scaling` kind `llama3` is Llama 3.1's frequency scaling (3.0: `none`).
    - `head_dim`: per head (Llama 3 uses `hidden_size / num_attention_heads`; a Hugging Face config.json
      without it gets that).
    - `tie_word_embeddings`: Llama 3.2 1B/3B tie the LM head to the embeddings, the others do not.
    - `vocab_splits`, `attention_backend`, `kernel_backend`, `loss_chunk_size`: as in `Qwen3Config`.
    - init: weights ~ N(0, `initializer_range`), output projections (o_proj, down_proj) scaled by
      1/sqrt(2 · num_layers).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(gt=0)
    vocab_splits: dict[str, int] | None = None
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    rms_norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(500_000.0, gt=0)
    rope_scaling: LlamaRopeScaling = Field(default_factory=NoRopeScaling)
    max_position_embeddings: int = Field(8192, gt=0)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = Field(0.02, gt=0)
    attention_backend: SdpaBackendName = "auto"
    loss_chunk_size: int = Field(2048, gt=0)
    kernel_backend: KernelBackend = "auto"

    @model_validator(mode="after")
    def _check(self) -> Llama3Config:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.vocab_splits is not None and sum(self.vocab_splits.values()) != self.vocab_size:
            raise ValueError(
                f"vocab_splits {self.vocab_splits} sum to {sum(self.vocab_splits.values())}, "
                f"not vocab_size={self.vocab_size}"
            )
        return self

    @property
    def splits(self) -> dict[str, int]:
        return dict(self.vocab_splits) if self.vocab_splits is not None else {"regular": self.vocab_size}

    @property
    def output_init_std(self) -> float:
        return self.initializer_range / math.sqrt(2 * self.num_layers)
