from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from d9d.modules.attention import GroupedQueryAttention
from d9d.modules.base import ModuleLateInit
from d9d.modules.embedding import TokenEmbedding
from d9d.modules.heads import CausalLMHead, EmbeddingHead, SequenceClassificationHead
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe import EagerGroupedMM, GroupedExperts, MoELayer, TopKRouter
from d9d.modules.norm import RMSNorm

BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "rms_norm": lambda: RMSNorm(64),
    "attention": lambda: GroupedQueryAttention(64, 8, 4, 16, init_std=0.05, output_init_std=0.01),
    "swiglu": lambda: SwiGLU(64, 256, init_std=0.05, output_init_std=0.01),
    "embedding": lambda: TokenEmbedding({"regular": 300, "special": 20}, 64, init_std=0.05),
    "lm_head": lambda: CausalLMHead(64, {"regular": 300}, init_std=0.05),
    "classification": lambda: SequenceClassificationHead(64, 300, init_std=0.05),
    "embedding_head": lambda: EmbeddingHead(64, projection_dim=300, init_std=0.05),
    "moe": lambda: MoELayer(
        TopKRouter(64, 8, 2, expert_bias=True, init_std=0.05),
        GroupedExperts(8, 64, 32, grouped_mm=EagerGroupedMM(), init_std=0.05, output_init_std=0.01),
        shared_expert=SwiGLU(64, 32, init_std=0.05, output_init_std=0.01),
        shared_expert_gate=True,
        init_std=0.05,
    ),
}

OUTPUT_PROJECTIONS = ("o_proj", "down_proj")


@pytest.mark.parametrize("name", list(BLOCKS))
def test_meta_build_then_materialize(name: str) -> None:
    with torch.device("meta"):
        block = BLOCKS[name]()
    assert isinstance(block, ModuleLateInit)
    tensors = dict(block.named_parameters()) | dict(block.named_buffers())
    assert tensors and all(t.is_meta for t in tensors.values())

    block.to_empty(device="cpu")
    block.reset_parameters()
    for param_name, param in block.named_parameters():
        assert not param.is_meta and torch.isfinite(param).all(), param_name
        if "norm" in param_name or name == "rms_norm":
            assert torch.equal(param, torch.ones_like(param)), param_name
        elif param_name.endswith("shared_expert_gate.weight"):
            continue  # 64 values: too few for a std estimate
        else:
            expected = 0.01 if any(p in param_name for p in OUTPUT_PROJECTIONS) else 0.05
            assert param.std().item() == pytest.approx(expected, rel=0.15), param_name
            assert abs(param.mean().item()) < expected / 4, param_name
    for buffer_name, buffer in block.named_buffers():
        assert torch.equal(buffer, torch.zeros_like(buffer)), buffer_name
