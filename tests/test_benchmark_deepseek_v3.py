"""`benchmarks/train_throughput.py --model deepseek_v3`: the shape's parameter and FLOP formulas against the
models themselves (d9d's, built on meta from the d9d row's own parsed job; torchtitan's, where it is
importable), the torchtitan model being the same function as d9d's on a tiny copy of the shape, and the
other shapes' accounting unchanged. No GPU; no number is checked for speed."""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import d9d.engine.config as engine_config
from d9d.engine.builtin.models import build_base_model
from d9d.models.deepseek_v3.attention import MultiHeadLatentAttention
from d9d.models.deepseek_v3.config import DeepSeekV3Config
from d9d.models.deepseek_v3.family import DEEPSEEK_V3 as FAMILY
from d9d.modules.moe import MoELayer
from d9d.modules.rotary import NoRopeScaling
from d9d.pipeline.api import PipelineStageInfo
from tests.bench_fixtures import import_benchmark


@pytest.fixture(scope="module")
def common() -> Iterator[ModuleType]:
    yield from import_benchmark("throughput.common")


class _Parsed(Exception):
    """Stops the d9d row right after it parsed its job (before any device is touched)."""


def _d9d_row_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The job the d9d row of `--model deepseek_v3` runs, as `d9d_peer.run` builds and parses it."""
    from throughput import d9d_peer

    real = engine_config.parse_config
    parsed: list[Any] = []

    def parse_and_stop(raw: Any) -> Any:
        parsed.append(real(raw))
        raise _Parsed

    monkeypatch.setattr(engine_config, "parse_config", parse_and_stop)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the run directory the row makes
    with pytest.raises(_Parsed):
        d9d_peer.run("deepseek_v3", "compiled", "random", steps=2, warmup=1, profile=False)
    return parsed[0]


def _d9d_meta_model(config: Any) -> tuple[Any, nn.Module]:
    provider = build_base_model(config.model, "model")
    with torch.device("meta"):
        module = provider.build_stage(PipelineStageInfo())
    return provider, module


def test_d9d_row_parses_and_builds_the_shape_on_meta(
    common: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = _d9d_row_config(monkeypatch, tmp_path)
    provider, module = _d9d_meta_model(config)
    c = provider.model_config
    assert isinstance(c, DeepSeekV3Config)
    assert provider.family is FAMILY and provider.dtype == torch.bfloat16
    assert c.q_lora_rank is None and c.first_k_dense == 1 and c.num_shared_experts == 1
    assert (c.num_expert_groups, c.topk_groups, c.routed_scaling_factor) == (8, 4, 2.5)
    # plain RoPE at the row's length (torchtitan applies YaRN only past 4096), no expert bias to update
    assert isinstance(c.rope_scaling, NoRopeScaling) and c.rope_theta == 10_000.0
    assert c.max_position_embeddings == common.SEQ and not c.expert_bias
    assert not any(name.endswith("expert_bias") for name, _ in module.named_buffers())
    counts = common.deepseek_v3_params(common.DEEPSEEK_V3)
    assert sum(p.numel() for p in module.parameters()) == counts["total"] == 1_982_047_232


def _active_matmul_params(module: nn.Module) -> int:
    """What one token multiplies by, read off the built model: every matrix but the embedding table, each
    MoE layer's routed experts at k of E (its router's top-k over its expert count)."""
    share: dict[int, float] = {}
    for sub in module.modules():
        if isinstance(sub, MoELayer):
            for p in sub.experts.parameters():
                share[id(p)] = sub.gate.top_k / sub.gate.num_experts
    total = sum(
        p.numel() * share.get(id(p), 1.0)
        for name, p in module.named_parameters()
        if p.dim() >= 2 and not name.startswith("model.embed_tokens.")
    )
    assert total == int(total)
    return int(total)


def test_flops_per_token_counts_the_built_models_active_parameters(
    common: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    provider, module = _d9d_meta_model(_d9d_row_config(monkeypatch, tmp_path))
    active = _active_matmul_params(module)
    assert active == common.deepseek_v3_params(common.DEEPSEEK_V3)["active"] == 505_217_024
    seq = common.SEQ
    attention = 0.0
    for sub in module.modules():
        if isinstance(sub, MultiHeadLatentAttention):
            heads = sub.kv_b_proj.out_features // (sub.nope_dim + sub.v_dim)
            # scores q·k over nope + rope dims, then p·v over v dims: 2 FLOPs a multiply-add, ×3 with the
            # backward, T/2 keys per query under the causal mask
            attention += 3 * 2 * heads * (sub.nope_dim + sub.rope_dim + sub.v_dim) * seq / 2
    expected = 6 * active + attention
    assert common.deepseek_v3_flops_per_token(common.DEEPSEEK_V3, seq) == pytest.approx(expected, rel=1e-12)
    assert common.model_flops_per_token("deepseek_v3") == pytest.approx(expected, rel=1e-12)
    # d9d's own cost model of the family (what its console reports as MFU) agrees
    assert provider.flops_per_token(seq) == pytest.approx(expected, rel=1e-12)


def test_other_shapes_keep_their_accounting(common: ModuleType) -> None:
    for model in ("dense", "moe", "llama3"):
        qwen_style = common.flops_per_token(common.ARCHS[model], model == "moe")
        assert common.model_flops_per_token(model) == qwen_style
    assert set(common.PROVIDERS) == set(common.ARCHS) == set(common.MODEL_NAMES)


def test_cli_plans_the_deepseek_rows(common: ModuleType) -> None:
    import train_throughput

    args = argparse.Namespace(
        model="deepseek_v3",
        peers=["d9d", "torchtitan"],
        d9d_variants=["compiled"],
        d9d_batches=["random"],
        titan_variants=["eager", "compile"],
        hf_variants=[],
        d9d_ac=["none"],
        titan_ac=["none"],
    )
    rows = train_throughput.plan(args)
    assert [(r.model, r.peer, r.variant) for r in rows] == [
        ("deepseek_v3", "d9d", "compiled"),
        ("deepseek_v3", "torchtitan", "eager"),
        ("deepseek_v3", "torchtitan", "compile"),
    ]
    # `both` stays the Qwen3 pair
    both = train_throughput.plan(argparse.Namespace(**{**vars(args), "model": "both"}))
    assert {r.model for r in both} == {"dense", "moe"}


# ---- torchtitan's own model (skipped where torchtitan 0.2.2 is not importable) ----


@pytest.fixture(scope="module")
def titan(common: ModuleType) -> ModuleType:
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    from throughput import titan_peer

    try:
        titan_peer._stub_unused_imports()
        import torchtitan.models.deepseek_v3  # noqa: F401
    except ImportError as e:  # an optional peer whose own dependencies (tyro, torchdata) are missing
        pytest.skip(f"torchtitan's deepseek_v3 does not import: {e}")
    return titan_peer


def _layer_numels(module: nn.Module, prefix: str) -> list[int]:
    counts: dict[int, int] = {}
    for name, p in module.named_parameters():
        if name.startswith(prefix):
            index = int(name[len(prefix) :].split(".")[0])
            counts[index] = counts.get(index, 0) + p.numel()
    return [counts[i] for i in sorted(counts)]


def test_torchtitan_model_has_the_same_parameters(
    common: ModuleType, titan: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    args = titan.deepseek_v3_model_args(common.DEEPSEEK_V3)
    with torch.device("meta"):
        theirs = titan.deepseek_v3_model_class()(args)
    provider, ours = _d9d_meta_model(_d9d_row_config(monkeypatch, tmp_path))
    total = common.deepseek_v3_params(common.DEEPSEEK_V3)["total"]
    assert sum(p.numel() for p in theirs.parameters()) == total
    assert _layer_numels(theirs, "layers.") == _layer_numels(ours, "model.layers.")
    router = theirs.layers["1"].moe.router
    assert (router.num_expert_groups, router.num_limited_groups, router.top_k) == (8, 4, 8)
    assert (router.score_func, router.route_norm, router.route_scale) == ("sigmoid", True, 2.5)
    assert theirs.layers["1"].moe.expert_bias is None and not theirs.layers["0"].moe_enabled
    assert theirs.layers["0"].attention.softmax_scale == pytest.approx(provider.model_config.softmax_scale)
    # the same rotary angles at every position (no YaRN; adjacent pairs, as d9d's interleaved style)
    from torchtitan.models.deepseek_v3.model.model import precompute_freqs_cis

    freqs = precompute_freqs_cis(args)
    rotary = ours.model.make_rotary()
    tables = rotary(torch.arange(common.SEQ)[None], torch.float32)
    torch.testing.assert_close(tables.cos[0, :, ::2], freqs.real)
    torch.testing.assert_close(tables.sin[0, :, ::2], freqs.imag)


def _copy_into_titan(ours: nn.Module, theirs: nn.Module) -> None:
    """d9d's weights under torchtitan's names (its experts store [E, out, in], d9d's [E, in, out])."""
    renames = {
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attention.wq",
        "self_attn.kv_a_proj_with_mqa": "attention.wkv_a",
        "self_attn.kv_a_layernorm": "attention.kv_norm",
        "self_attn.kv_b_proj": "attention.wkv_b",
        "self_attn.o_proj": "attention.wo",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.up_proj": "feed_forward.w3",
        "mlp.down_proj": "feed_forward.w2",
        "mlp.gate.weight": "moe.router.gate.weight",
        "mlp.shared_expert.gate_proj": "moe.shared_experts.w1",
        "mlp.shared_expert.up_proj": "moe.shared_experts.w3",
        "mlp.shared_expert.down_proj": "moe.shared_experts.w2",
        "mlp.experts.down_proj": "moe.experts.w2",
    }
    state: dict[str, torch.Tensor] = {}
    for name, p in ours.named_parameters():
        if name == "model.embed_tokens.weights.regular":
            state["tok_embeddings.weight"] = p
        elif name == "lm_head.weights.regular":
            state["output.weight"] = p
        elif name == "model.norm.weight":
            state["norm.weight"] = p
        else:
            local = name.removeprefix("model.")
            for old, new in renames.items():
                local = local.replace(f".{old}", f".{new}")
            if local.endswith(".mlp.experts.gate_up_proj"):  # d9d fuses gate (first half) and up
                prefix = local.removesuffix("mlp.experts.gate_up_proj")
                gate, up = p.transpose(1, 2).chunk(2, dim=1)
                state[f"{prefix}moe.experts.w1"], state[f"{prefix}moe.experts.w3"] = gate, up
            else:
                state[local] = p.transpose(1, 2) if ".moe.experts." in local else p
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and all("freqs_cis" in k or "tokens_per_expert" in k for k in missing), missing


def test_torchtitan_model_computes_what_d9d_computes(
    common: ModuleType, titan: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny copy of the shape (every switch the same, small widths): equal weights give equal per-token
    losses, so routing (sigmoid, 4 of 8 groups, renormalized, ×2.5), MLA and RoPE agree, not just sizes."""
    tiny = {
        **common.DEEPSEEK_V3,
        "vocab_size": 96,
        "hidden_size": 32,
        "num_layers": 3,
        "intermediate_size": 48,
        "num_attention_heads": 2,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "moe_intermediate_size": 16,
        "num_experts": 16,
        "num_experts_per_tok": 4,
    }
    seq = 24
    torch.manual_seed(0)
    # weights larger than the default init: sharper attention, so RoPE shows in the losses too
    config = DeepSeekV3Config(
        **tiny, max_position_embeddings=seq, kernel_backend="torch", rms_norm_eps=1e-6, initializer_range=0.2
    )
    ours = FAMILY.build_causal_lm(config, PipelineStageInfo()).eval()
    args = titan.deepseek_v3_model_args(tiny, seq_len=seq)
    args.norm_eps = 1e-6  # d9d's norms' epsilon (the throughput rows keep each framework's default)
    args.moe_args.use_grouped_mm = False  # torch._grouped_mm wants a GPU; the loop does the same math
    # torchtitan counts tokens per expert with histc over int64 ids, which only CUDA implements
    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda ids, *a, **k: histc(ids.float(), *a, **k).to(ids.dtype))
    theirs = titan.deepseek_v3_model_class()(args).eval()
    theirs.norm.eps = 1e-6
    _copy_into_titan(ours, theirs)
    ids = torch.randint(0, tiny["vocab_size"], (2, seq + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(input_ids=ids[:, :-1], labels=ids[:, 1:])["loss"]
        logits = theirs(ids[:, :-1])
    targets = ids[:, 1:].flatten()
    got = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets, reduction="none")
    torch.testing.assert_close(got.view_as(expected), expected, rtol=1e-5, atol=1e-5)
