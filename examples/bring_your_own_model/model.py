"""A language model that is not in d9d's catalogue, written as plain PyTorch, plus the two small classes
that plug it into the engine: a model provider and a training task.

The model is a small GPT-style decoder (learned positions, pre-norm blocks, causal attention, GELU MLP).
Every module that owns parameters has `reset_parameters()`, so the engine can build it on the meta device,
lay out data parallelism, and only then allocate and initialize the weights.

The config references these classes by import path, e.g.
`examples.bring_your_own_model.model:TinyGPTProvider` (the repository root on PYTHONPATH).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn import functional as F

from d9d.core import DistributedContext, MeshDomain
from d9d.engine.events import EventBus
from d9d.engine.providers import LossOutput
from d9d.metrics import MeanMetric
from d9d.modules.base import ModuleLateInit
from d9d.parallel import parallelize_replicate
from d9d.pipeline.api import PipelineStageInfo
from d9d.state import save_model_state

IGNORE_INDEX = -100  # label of padding and of each document's last token (d9d.data's collator)

# -- the model: white-box modules, composed explicitly -----------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, init_std: float, out_std: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.init_std, self.out_std = init_std, out_std
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.qkv.weight, std=self.init_std)
        nn.init.normal_(self.out.weight, std=self.out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        # Right padding needs no mask under causal attention: real tokens never look ahead at it.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(batch, seq, hidden))
        return out


class MLP(nn.Module):
    def __init__(self, hidden_size: int, init_std: float, out_std: float) -> None:
        super().__init__()
        self.init_std, self.out_std = init_std, out_std
        self.up = nn.Linear(hidden_size, 4 * hidden_size)
        self.down = nn.Linear(4 * hidden_size, hidden_size)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.up.weight, std=self.init_std)
        nn.init.normal_(self.down.weight, std=self.out_std)
        nn.init.zeros_(self.up.bias)
        nn.init.zeros_(self.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, hidden_size: int, num_heads: int, init_std: float, out_std: float) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden_size)
        self.attn = CausalSelfAttention(hidden_size, num_heads, init_std, out_std)
        self.mlp_norm = nn.RMSNorm(hidden_size)
        self.mlp = MLP(hidden_size, init_std, out_std)

    def reset_parameters(self) -> None:
        self.attn_norm.reset_parameters()
        self.attn.reset_parameters()
        self.mlp_norm.reset_parameters()
        self.mlp.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class TinyGPT(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, max_positions: int
    ) -> None:
        super().__init__()
        init_std = 0.02
        out_std = init_std / math.sqrt(2 * num_layers)  # residual outputs: keep the stream's scale
        self.tokens = nn.Embedding(vocab_size, hidden_size)
        self.positions = nn.Embedding(max_positions, hidden_size)
        self.blocks = nn.ModuleList(
            Block(hidden_size, num_heads, init_std, out_std) for _ in range(num_layers)
        )
        self.norm = nn.RMSNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)
        for block in self.blocks:
            assert isinstance(block, ModuleLateInit)
            block.reset_parameters()
        self.norm.reset_parameters()
        nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab]; `position_ids` restart at 0 in every document."""
        x = self.tokens(input_ids) + self.positions(position_ids)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


# -- the provider: how the engine builds, distributes, initializes and exports it --------------------------


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TinyGPTProvider:
    class Config(_Options):  # `model.options` in the job file, validated before any process starts
        vocab_size: int = Field(259, ge=1)  # d9d's byte tokenizer
        hidden_size: int = Field(64, ge=1)
        num_layers: int = Field(2, ge=1)
        num_heads: int = Field(4, ge=1)
        max_positions: int = Field(128, ge=1)

    def __init__(self, config: Config) -> None:
        if config.hidden_size % config.num_heads:
            raise ValueError(f"hidden_size={config.hidden_size} is not divisible by num_heads")
        self.config = config

    def build_stage(self, stage: PipelineStageInfo) -> nn.Module:
        """Called under torch.device('meta'): nothing is allocated yet."""
        if stage.num_stages != 1:
            raise NotImplementedError(
                "TinyGPT is not split into pipeline stages; set mesh.pipeline_parallel=1"
            )
        return TinyGPT(**self.config.model_dump())

    def parallelize(self, module: nn.Module, ctx: DistributedContext) -> None:
        """Pure data parallelism: replicate the weights over the batch domain's `dp` ranks (DTensors); the
        engine's gradient synchronizer all-reduces what this marks."""
        if ctx.params.data_parallel > 1:
            parallelize_replicate(module, ctx.mesh_for(MeshDomain.BATCH)["dp"])

    def initialize(self, module: nn.Module, ctx: DistributedContext) -> None:
        """After to_empty on the device. The engine seeded the parameter RNG identically on every replica."""
        assert isinstance(module, TinyGPT)
        module.reset_parameters()

    def export(self, modules: Sequence[nn.Module], ctx: DistributedContext, path: Path) -> None:
        """model.safetensors (replicas gathered, written once) and the options as config.json."""
        save_model_state(
            path,
            list(modules),
            distributed=ctx.is_distributed,
            overwrite=True,
            extra_files={"config.json": self.config.model_dump_json(indent=2) + "\n"},
        )

    def subscribe(
        self,
        events: EventBus,
        modules: Sequence[nn.Module],
        ctx: DistributedContext,
        metrics: dict[str, float],
    ) -> None:
        """Step logic of the model's own (e.g. balancing MoE experts after each optimizer step) would hook to
        the engine's events here; TinyGPT has none."""
        return None


def load_exported(path: Path) -> TinyGPT:
    """The exported model back as a plain module (strict: every key must match)."""
    from safetensors.torch import load_file

    options = TinyGPTProvider.Config.model_validate(json.loads((path / "config.json").read_text()))
    model = TinyGPT(**options.model_dump())
    model.load_state_dict(load_file(path / "model.safetensors"), strict=True)
    return model.eval()


# -- the task: what goes into the model and how the loss is computed ----------------------------------------


class NextTokenTask:
    """Token cross-entropy as a sum plus its weight (the number of target tokens): the engine divides by
    the global weight, so a step's loss is the mean over every target token of the global batch."""

    class Config(_Options):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def forward_inputs(self, microbatch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {"input_ids": microbatch["input_ids"], "position_ids": microbatch["position_ids"]}

    def compute_loss(self, outputs: torch.Tensor, microbatch: Mapping[str, Any]) -> LossOutput:
        labels = microbatch["labels"]  # already the next token, -100 where there is none
        loss = F.cross_entropy(
            outputs.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return LossOutput(loss, (labels != IGNORE_INDEX).sum().to(loss.dtype))

    def create_metrics(self) -> dict[str, Any]:
        return {"accuracy": MeanMetric()}  # synced over ranks and logged by the engine

    def update_metrics(
        self,
        metrics: Mapping[str, Any],
        outputs: torch.Tensor,
        microbatch: Mapping[str, Any],
        loss: LossOutput,
    ) -> None:
        labels = microbatch["labels"]
        targets = labels != IGNORE_INDEX
        metrics["accuracy"].update((outputs.argmax(-1) == labels)[targets].float())
