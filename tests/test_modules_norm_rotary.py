from __future__ import annotations

import math
import textwrap

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from d9d.modules.mlp import SwiGLU
from d9d.modules.norm import RMSNorm
from d9d.modules.rotary import (
    DynamicNTKRopeScaling,
    LinearRopeScaling,
    NoRopeScaling,
    RotaryEmbedding,
    YarnRopeScaling,
)
from tests.triton_interpreter import run_in_interpreter


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


# --- the fused kernels wired into the modules (d9d.kernels.{rms_norm,swiglu,rotary}) ---


def _tiny_layer(kernel_backend: str) -> tuple[object, ...]:
    from d9d.models.qwen3.config import Qwen3Config as D9dQwen3Config
    from d9d.models.qwen3.layer import Qwen3DecoderLayer, qwen3_mlp
    from d9d.modules.attention import AttentionMask, build_sdpa_backend

    torch.manual_seed(0)
    config = D9dQwen3Config(
        vocab_size=32,
        hidden_size=48,
        num_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=12,
        intermediate_size=40,
        attention_backend="torch",
        kernel_backend=kernel_backend,  # type: ignore[arg-type]
    )
    layer = Qwen3DecoderLayer(config, 0, build_sdpa_backend("torch"), qwen3_mlp(config, 40))
    tables = RotaryEmbedding(12, 10000.0)(torch.arange(5).expand(2, 5), torch.float32)
    return layer, tables, AttentionMask(padding=None, segment_ids=None)


def test_layer_wires_the_backend_into_every_norm_mlp_and_the_fused_add() -> None:
    layer, tables, mask = _tiny_layer("triton")
    assert isinstance(layer, torch.nn.Module)
    norms = [m for m in layer.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 4 and all(m.backend == "triton" for m in norms)
    # the fused add + norm keeps HF's parameter names
    assert sorted(n for n, _ in layer.named_parameters() if "norm" in n) == [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.k_norm.weight",
        "self_attn.q_norm.weight",
    ]
    explanation = torch._dynamo.explain(layer)(torch.randn(2, 5, 48), tables, mask)
    assert explanation.graph_break_count == 0
    ops = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
    assert {
        "d9d.rms_norm.default",
        "d9d.add_rms_norm.default",
        "d9d.rope_qk.default",
        "d9d.swiglu.default",
    } <= ops
    # `auto` inside a compiled region leaves the elementwise work to inductor: no custom op is traced
    auto_layer, _, _ = _tiny_layer("auto")
    explanation = torch._dynamo.explain(auto_layer)(torch.randn(2, 5, 48), tables, mask)
    assert not [
        op
        for graph in explanation.graphs
        for op in map(str, (n.target for n in graph.graph.nodes))
        if "d9d" in op
    ]


def test_compiled_layer_with_the_custom_ops_matches_the_eager_reference() -> None:
    """fullgraph inductor compile on CPU: the ops' fake and autograd registrations, their CPU twins."""
    reference, tables, mask = _tiny_layer("torch")
    fused, _, _ = _tiny_layer("triton")
    assert isinstance(reference, torch.nn.Module) and isinstance(fused, torch.nn.Module)
    compiled = torch.compile(fused, fullgraph=True)
    x = torch.randn(2, 5, 48)
    results = []
    for module in (reference, compiled):
        leaf = x.clone().requires_grad_()
        out = module(leaf, tables, mask)
        out.square().sum().backward()
        results.append([out.detach(), leaf.grad, *(p.grad for p in module.parameters())])
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


# Runs in a fresh interpreter (TRITON_INTERPRET=1): every RMSNorm, SwiGLU and RoPE of the model runs the
# Triton kernels on CPU tensors. The tokens follow a learnable rule (next = current + 1) so the loss falls.
_TRAINING_CHECK = textwrap.dedent(
    """
    import torch
    from d9d.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

    def train(kernel_backend):
        torch.manual_seed(0)
        config = Qwen3Config(
            vocab_size=64, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
            head_dim=16, intermediate_size=96, attention_backend="torch", kernel_backend=kernel_backend,
        )
        model = Qwen3ForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(30):
            ids = (torch.randint(0, 64, (4, 1), generator=generator) + torch.arange(12)) % 64
            loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:])["loss"].mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return torch.tensor(losses)

    reference, fused = train("torch"), train("triton")
    assert reference[-5:].mean() < 0.5 * reference[:5].mean(), reference
    torch.testing.assert_close(fused, reference, rtol=1e-3, atol=1e-3)
    print("interpreter ok")
    """
)


def test_training_with_triton_kernels_tracks_the_reference_in_the_interpreter() -> None:
    run_in_interpreter(_TRAINING_CHECK)


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_every_fused_block_of_a_qwen3_layer_takes_the_configured_backend(kernel_backend: str) -> None:
    """The config's `kernel_backend` reaches every norm (the q/k norms included) and the MLP."""
    layer = _tiny_layer(kernel_backend)[0]
    assert isinstance(layer, torch.nn.Module)
    blocks = [m for m in layer.modules() if isinstance(m, RMSNorm | SwiGLU)]
    assert len(blocks) == 5  # input, post-attention, q and k norms; the MLP
    assert {m.backend for m in blocks} == {kernel_backend}
