from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from d9d.modules.norm import RMSNorm
from d9d.modules.rotary import (
    DynamicNTKRopeScaling,
    LinearRopeScaling,
    NoRopeScaling,
    RotaryEmbedding,
    YarnRopeScaling,
)


def test_rms_norm_matches_float64_formula_and_hf() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x64 = x.double()
    expected = norm.weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-6, atol=1e-6)
    hf = Qwen3RMSNorm(16, eps=1e-5)
    hf.weight.data.copy_(norm.weight.data)
    torch.testing.assert_close(norm(x), hf(x), rtol=0, atol=0)


def test_zero_centered_rms_norm_is_offset_from_one() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    centered = RMSNorm(8, zero_centered=True)
    plain = RMSNorm(8)
    assert torch.equal(centered.weight, torch.zeros(8))
    with torch.no_grad():
        centered.weight.uniform_(-0.3, 0.3)
        plain.weight.copy_(1 + centered.weight)
    torch.testing.assert_close(centered(x), plain(x))


def _hf_config(rope_parameters: dict[str, object], max_pos: int = 16) -> Qwen3Config:
    return Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=max_pos,
        rope_parameters=rope_parameters,
    )


SCALINGS = [
    (NoRopeScaling(), {"rope_type": "default", "rope_theta": 10000.0}),
    (LinearRopeScaling(factor=4.0), {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    (
        DynamicNTKRopeScaling(factor=2.0, original_max_position_embeddings=16),
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    ),
    (
        YarnRopeScaling(factor=4.0, original_max_position_embeddings=16),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    ),
    (
        YarnRopeScaling(
            factor=8.0,
            original_max_position_embeddings=8,
            beta_fast=16,
            beta_slow=2,
            mscale=0.7,
            mscale_all_dim=0.5,
        ),
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "mscale": 0.7,
            "mscale_all_dim": 0.5,
            "rope_theta": 10000.0,
        },
    ),
]


@pytest.mark.parametrize(("scaling", "hf_params"), SCALINGS, ids=lambda v: getattr(v, "kind", ""))
def test_rotary_tables_match_hf(scaling: object, hf_params: dict[str, object]) -> None:
    # 40 positions exceed max_position_embeddings=16, so dynamic NTK actually stretches its base
    position_ids = torch.tensor([list(range(40)), list(range(7, 47))])
    ours = RotaryEmbedding(16, 10000.0, scaling)(position_ids, torch.float32)  # type: ignore[arg-type]
    hf = Qwen3RotaryEmbedding(_hf_config(hf_params))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), position_ids)
    torch.testing.assert_close(ours.cos, cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.sin, sin, rtol=1e-6, atol=1e-6)


def test_yarn_attention_factor_default_formula() -> None:
    tables = RotaryEmbedding(16, 10000.0, YarnRopeScaling(factor=4.0, original_max_position_embeddings=16))(
        torch.zeros(1, 1, dtype=torch.long), torch.float64
    )
    assert tables.cos[0, 0, 0].item() == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_rotation_is_relative_and_norm_preserving() -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, 100.0, style="interleaved")
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(pq: int, pk: int) -> float:
        tq = rope(torch.tensor([[pq]]), torch.float64)
        tk = rope(torch.tensor([[pk]]), torch.float64)
        return float((tq.apply(q) * tk.apply(k)).sum())

    # angles are computed in float32 (as Hugging Face does), so relativity holds to float32 precision
    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
    rotated = rope(torch.tensor([[9]]), torch.float64).apply(q)
    assert rotated.norm().item() == pytest.approx(q.norm().item(), rel=1e-6)


def test_interleaved_style_is_half_style_on_permuted_dims() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8)
    positions = torch.arange(5).expand(2, 5)
    half = RotaryEmbedding(8, 500.0, style="half")(positions, torch.float32)
    inter = RotaryEmbedding(8, 500.0, style="interleaved")(positions, torch.float32)
    # interleaved pairs (2i, 2i+1) correspond to half-style pairs (i, i + d/2)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    torch.testing.assert_close(inter.apply(x)[..., perm], half.apply(x[..., perm]))
