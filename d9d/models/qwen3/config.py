"""Qwen3 dense architecture hyper-parameters."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.kernels.backend import KernelBackend
from d9d.modules.attention import SdpaBackendName
from d9d.modules.rotary import NoRopeScaling, RopeScaling, RotaryStyle


class Qwen3Config(BaseModel):
    """Everything that shapes a Qwen3 model. Field names follow d9d, not Hugging Face; `d9d.models.hf`
    converts `config.json` both ways.

    - `vocab_splits`: named id ranges (in id order) stored as separate parameters, e.g.
      `{"regular": 151643, "special": 293}`; default one split named `regular`.
    - `sliding_window` applies to the layers in `sliding_window_layers` (all layers when None).
    - `kernel_backend`: the fused RMSNorm / SwiGLU / RoPE kernels (`triton`), their PyTorch references
      (`torch`), or `auto` (Triton on CUDA in eager code, the reference inside `torch.compile`d regions,
      where inductor fuses it; see docs/kernels.md).
    - init: weights ~ N(0, `initializer_range`), output projections (o_proj, down_proj) scaled by
      1/sqrt(2 · num_layers) so the residual stream's variance does not grow with depth.
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
    rms_norm_eps: float = Field(1e-6, gt=0)
    rope_theta: float = Field(1_000_000.0, gt=0)
    rope_scaling: RopeScaling = Field(default_factory=NoRopeScaling)
    rope_style: RotaryStyle = "half"
    max_position_embeddings: int = Field(40960, gt=0)
    attention_bias: bool = False
    sliding_window: int | None = Field(None, gt=0)
    sliding_window_layers: tuple[int, ...] | None = None
    tie_word_embeddings: bool = False
    initializer_range: float = Field(0.02, gt=0)
    attention_backend: SdpaBackendName = "auto"
    # Tokens per chunk of the fused LM head + loss: each chunk holds [chunk, vocab] logits (0.6 GB in bf16 at
    # 2048 × 152k) and adds its weight gradient into a float32 [vocab, hidden] accumulator, so fewer chunks
    # cost less; 2048 measured ~5% faster than 1024 for the benchmark MoE on an H100 for +0.3 GB.
    loss_chunk_size: int = Field(2048, gt=0)
    kernel_backend: KernelBackend = "auto"

    @model_validator(mode="after")
    def _check(self) -> Qwen3Config:
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
        bad = [i for i in self.sliding_window_layers or () if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"sliding_window_layers {bad} outside [0, num_layers={self.num_layers})")
        return self

    @property
    def splits(self) -> dict[str, int]:
        return dict(self.vocab_splits) if self.vocab_splits is not None else {"regular": self.vocab_size}

    @property
    def output_init_std(self) -> float:
        return self.initializer_range / math.sqrt(2 * self.num_layers)

    def layer_window(self, layer: int) -> int | None:
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None
