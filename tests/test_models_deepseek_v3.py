"""DeepSeek-V3-style MoE: parity with transformers' `DeepseekV3ForCausalLM` (float32, tiny random models with
random norms and expert biases: logits, loss and every gradient within 1e-5), the router against HF's, and
Hugging Face import/export with the expert bias kept as `e_score_correction_bias`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

import d9d.models as dm
from d9d.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3ForCausalLM
from d9d.models.hf import config_from_hf, config_to_hf, d9d_to_hf_mapper
from d9d.modules.moe import TopKRouter
from d9d.state import apply_group

VOCAB = 96
HF_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "initializer_range": 0.1,  # decisive routing: near-ties between experts would make top-k fragile
    "rms_norm_eps": 1e-5,
}
CASES: dict[str, dict[str, Any]] = {
    # low-rank queries, interleaved RoPE, 4 groups of 2 experts (a token's experts from its best 2 groups),
    # one shared expert, the first layer dense, DeepSeek-V3's weight scaling
    "v3": {
        "q_lora_rank": 24,
        "rope_interleave": True,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    },
    # full-rank queries (V2-Lite style), half-layout RoPE, no groups, two shared experts, all layers MoE,
    # unnormalized weights, biases on the attention projections
    "lite": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "attention_bias": True,
    },
}


def _hf_model(**extra: Any) -> transformers.DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_COMMON, **extra))
    with torch.no_grad():  # random norms, biases and expert biases make the parity stricter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    return model.eval()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    hf = _hf_model(**CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, dm.from_pretrained(path), path


def _ids(batch: int = 2, seq: int = 13) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def test_the_router_is_transformers(pair) -> None:
    """Sigmoid scores, the bias for selection only, group-limited top-k, renormalization, scaling."""
    hf, ours, _ = pair
    layer = hf.config.first_k_dense_replace
    hf_gate = hf.model.layers[layer].mlp.gate
    our_gate = ours.model.decoder_layers()[layer].mlp.gate
    assert isinstance(our_gate, TopKRouter)
    torch.testing.assert_close(our_gate.expert_bias, hf_gate.e_score_correction_bias, rtol=0, atol=0)
    x = torch.randn(64, HF_COMMON["hidden_size"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, want_weights, want_ids = hf_gate(x)
        routing = our_gate(x)
    order_hf, order_ours = want_ids.sort(dim=-1), routing.topk_ids.sort(dim=-1)
    assert torch.equal(order_ours.values, order_hf.values)
    torch.testing.assert_close(
        routing.topk_weights.gather(1, order_ours.indices), want_weights.gather(1, order_hf.indices)
    )


def test_from_pretrained_builds_deepseek_v3(pair) -> None:
    hf, ours, _ = pair
    assert type(ours) is DeepSeekV3ForCausalLM
    c = ours.config
    assert (c.q_lora_rank, c.num_expert_groups, c.first_k_dense) == (
        hf.config.q_lora_rank,
        hf.config.n_group,
        hf.config.first_k_dense_replace,
    )
    assert c.expert_bias  # DeepSeek-V3 routes with the bias


def test_logits_match(pair) -> None:
    hf, ours, _ = pair
    ids = _ids()
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(input_ids=ids)["logits"]
    assert got.shape == expected.shape
    assert _rel_err(got, expected) <= 1e-5


def _shifted(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def test_loss_and_every_gradient_match(pair) -> None:
    hf, ours, _ = pair
    ids = _ids()
    labels_hf = ids.clone()
    labels_hf[0, 5] = -100
    hf.zero_grad()
    ours.zero_grad()
    hf_loss = hf(ids, labels=labels_hf).loss
    hf_loss.backward()
    labels = _shifted(labels_hf)
    loss = ours(input_ids=ids, labels=labels)["loss"].sum() / (labels != -100).sum()
    loss.backward()
    assert abs(loss.item() - hf_loss.item()) <= 1e-5 * abs(hf_loss.item())

    grads = {name: p.grad for name, p in ours.named_parameters()}
    mapper = d9d_to_hf_mapper(ours.config, expert_layout="fused")  # transformers v5's in-memory layout
    got: dict[str, torch.Tensor] = {}
    for group in mapper.groups():
        if group.inputs <= grads.keys():  # the expert bias is a buffer: no gradient
            got |= apply_group(mapper, group, {k: grads[k] for k in group.inputs})
    expected = {name: p.grad for name, p in hf.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert _rel_err(got[name], grad) <= 1e-5, name


def test_an_export_keeps_the_bias_and_loads_in_transformers(tmp_path: Path) -> None:
    config = DeepSeekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=2,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_expert_groups=2,
        topk_groups=1,
        first_k_dense=1,
        routed_scaling_factor=2.0,
        initializer_range=0.1,
    )
    torch.manual_seed(3)
    model = DeepSeekV3ForCausalLM(config)
    model.reset_parameters()
    gate = model.model.decoder_layers()[1].mlp.gate
    with torch.no_grad():
        gate.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))  # as after some balancing steps
    dest = dm.save_pretrained(model, tmp_path / "export")
    assert json.loads((dest / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    tensors = load_file(dest / "model.safetensors")
    torch.testing.assert_close(tensors["model.layers.1.mlp.gate.e_score_correction_bias"], gate.expert_bias)
    hf = transformers.AutoModelForCausalLM.from_pretrained(dest).eval()
    assert type(hf) is transformers.DeepseekV3ForCausalLM
    ids = _ids(2, 9)
    with torch.no_grad():
        assert _rel_err(model(input_ids=ids)["logits"], hf(ids).logits) <= 1e-5
    again = dm.from_pretrained(dest)
    assert again.config == config
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_config_conversion_refuses_what_it_cannot_reproduce() -> None:
    hf = transformers.DeepseekV3Config(**HF_COMMON, q_lora_rank=24).to_dict()
    with pytest.raises(ValueError, match="num_key_value_heads=2 differs"):
        config_from_hf({**hf, "num_key_value_heads": 2})
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        config_from_hf({**hf, "hidden_act": "gelu"})
    config = config_from_hf(hf)
    assert config_from_hf(config_to_hf(config)) == config
