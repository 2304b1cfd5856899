"""Parity with transformers (float32, tiny random models) and Hugging Face checkpoint I/O."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

import d9d.models as dm
from d9d.models.hf import config_from_hf, d9d_to_hf_mapper, hf_to_d9d_mapper
from d9d.modules.attention import segment_ids_from_position_ids
from d9d.pipeline.api import PipelineStageInfo
from d9d.state import CheckpointFormatError, apply_group

VOCAB = 320
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "initializer_range": 0.1,  # decisive routing: near-ties between experts would make top-k fragile
}
MOE = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [1]}


def _hf_model(kind: str, **extra: object) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if kind == "qwen3":
        config = transformers.Qwen3Config(**COMMON, **extra)  # type: ignore[arg-type]
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(**COMMON, **MOE, **extra)  # type: ignore[arg-type]
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # HF initializes norms to one; random norms make the parity test stricter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def _save_hf(model: transformers.PreTrainedModel, path: Path, **kwargs: object) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen3_moe_unnormalized": ("qwen3_moe", {"norm_topk_prob": False, "decoder_sparse_step": 1}),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    kind, extra = CASES[request.param]
    hf = _hf_model(kind, **extra)
    path = _save_hf(hf, tmp_path_factory.mktemp(request.param))
    return hf, dm.from_pretrained(path), path


def _inputs(batch: int = 2, seq: int = 11) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _shifted(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def test_from_pretrained_picks_the_model_class(pair) -> None:
    hf, ours, _ = pair
    expected = dm.Qwen3MoEForCausalLM if hf.config.model_type == "qwen3_moe" else dm.Qwen3ForCausalLM
    assert type(ours) is expected
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings


def test_logits_match(pair) -> None:
    hf, ours, _ = pair
    ids = _inputs()
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(input_ids=ids)["logits"]
    assert got.shape == expected.shape
    assert _rel_err(got, expected) <= 1e-5


def _hf_grads_by_name(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _our_grads_in_hf_layout(model: dm.Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """Our gradients pushed through the save mapper (fused experts = transformers v5's in-memory layout)."""
    state = {}
    for key in model.state_dict():
        param = model.get_parameter(key)
        assert param.grad is not None, key
        state[key] = param.grad
    mapper = d9d_to_hf_mapper(model.config, expert_layout="fused")
    out: dict[str, torch.Tensor] = {}
    for group in mapper.groups():
        out |= apply_group(mapper, group, {k: state[k] for k in group.inputs})
    return out


def test_loss_and_every_gradient_match(pair) -> None:
    hf, ours, _ = pair
    ids = _inputs()
    ids_labels = ids.clone()
    ids_labels[0, 4] = -100  # an ignored target
    hf.zero_grad()
    ours.zero_grad()
    hf_loss = hf(ids, labels=ids_labels).loss
    hf_loss.backward()

    labels = _shifted(ids_labels)
    per_token = ours(input_ids=ids, labels=labels)["loss"]
    assert per_token.shape == ids.shape and per_token.dtype == torch.float32
    assert torch.all(per_token[labels == -100] == 0)
    loss = per_token.sum() / (labels != -100).sum()
    loss.backward()
    assert abs(loss.item() - hf_loss.item()) <= 1e-5 * abs(hf_loss.item())

    expected = _hf_grads_by_name(hf)
    got = _our_grads_in_hf_layout(ours)
    if hf.config.tie_word_embeddings:
        got.pop("lm_head.weight", None)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert _rel_err(got[name], grad) <= 1e-5, name


def test_padding_mask(pair) -> None:
    hf, ours, _ = pair
    ids = _inputs(3, 9)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, -4:] = 0  # right padding
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).logits
        got = ours(input_ids=ids, attention_mask=mask)["logits"]
    valid = mask.bool()
    assert _rel_err(got[valid], expected[valid]) <= 1e-5
    assert torch.isfinite(got).all()


def test_non_contiguous_position_ids(pair) -> None:
    hf, ours, _ = pair
    ids = _inputs(2, 10)
    positions = torch.tensor([[0, 1, 2, 7, 8, 9, 10, 20, 21, 22], list(range(100, 110))])
    with torch.no_grad():
        # an explicit all-ones mask keeps transformers from reading the jumps as packed sequences
        expected = hf(ids, position_ids=positions, attention_mask=torch.ones_like(ids)).logits
        got = ours(input_ids=ids, position_ids=positions)["logits"]
    assert _rel_err(got, expected) <= 1e-5


def test_packed_sequences_from_restarting_positions(pair) -> None:
    hf, ours, _ = pair
    ids = _inputs(2, 10)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], list(range(10))])
    with torch.no_grad():
        # without a cache, transformers detects packing from the restarts and masks across them
        expected = hf(ids, position_ids=positions, use_cache=False).logits
        got = ours(
            input_ids=ids, position_ids=positions, segment_ids=segment_ids_from_position_ids(positions)
        )
    assert _rel_err(got["logits"], expected) <= 1e-5
    with torch.no_grad():  # the segments matter: attending across documents changes the packed row
        unsegmented = ours(input_ids=ids, position_ids=positions)["logits"]
    assert _rel_err(unsegmented[0], expected[0]) > 1e-2


ROPE = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 8,
        "rope_theta": 10000.0,
    },
}


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("rope", list(ROPE))
def test_rope_scaling_variants(kind: str, rope: str, tmp_path: Path) -> None:
    # max_position_embeddings=8 < 14 positions: dynamic NTK really rescales, YaRN runs past its original span
    hf = _hf_model(kind, rope_parameters=ROPE[rope], max_position_embeddings=8)
    ours = dm.from_pretrained(_save_hf(hf, tmp_path))
    assert ours.config.rope_scaling.kind == rope
    ids = _inputs(2, 14)
    with torch.no_grad():
        assert _rel_err(ours(input_ids=ids)["logits"], hf(ids).logits) <= 1e-5


def test_sliding_window_layers(tmp_path: Path) -> None:
    hf = _hf_model("qwen3", use_sliding_window=True, sliding_window=3, max_window_layers=1)
    ours = dm.from_pretrained(_save_hf(hf, tmp_path))
    assert ours.config.sliding_window_layers == (1, 2)
    ids = _inputs(2, 9)
    with torch.no_grad():
        assert _rel_err(ours(input_ids=ids)["logits"], hf(ids).logits) <= 1e-5


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_save_pretrained_loads_in_transformers(pair, layout: str, tmp_path: Path) -> None:
    hf, ours, _ = pair
    dest = dm.save_pretrained(ours, tmp_path / "out", expert_layout=layout)  # type: ignore[arg-type]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(dest).eval()
    assert type(reloaded) is type(hf)
    ids = _inputs()
    with torch.no_grad():
        assert _rel_err(reloaded(ids).logits, ours(input_ids=ids)["logits"]) <= 1e-5
    round_trip = dm.from_pretrained(dest)
    for (key, a), (_, b) in zip(round_trip.state_dict().items(), ours.state_dict().items(), strict=True):
        assert torch.equal(a, b), key


def test_fused_expert_checkpoint_loads(tmp_path: Path) -> None:
    """transformers v5 keeps experts fused in memory; a checkpoint written from that state must load."""
    hf = _hf_model("qwen3_moe", norm_topk_prob=True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()
    tmp_path.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(hf.config.to_json_string())
    ours = dm.from_pretrained(tmp_path)
    ids = _inputs()
    with torch.no_grad():
        assert _rel_err(ours(input_ids=ids)["logits"], hf(ids).logits) <= 1e-5


def test_sharded_checkpoint_dtype_and_stage(tmp_path: Path) -> None:
    hf = _hf_model("qwen3_moe", norm_topk_prob=True)
    path = _save_hf(hf, tmp_path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    bf16 = dm.from_pretrained(path, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.model.layers["0"].mlp.gate.expert_load.dtype == torch.int64  # router counts stay exact
    last = dm.from_pretrained(path, stage=PipelineStageInfo(1, 2))
    full = dm.from_pretrained(path)
    for key, value in last.state_dict().items():
        assert torch.equal(value, full.state_dict()[key]), key
    assert last.model.embed_tokens is None and last.lm_head is not None


def _corrupt(src: Path, dest: Path, edit) -> Path:
    from safetensors.torch import load_file

    dest.mkdir()
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dest / "model.safetensors")
    (dest / "config.json").write_text((src / "config.json").read_text())
    return dest


def test_checkpoint_errors_name_key_and_shapes(tmp_path: Path) -> None:
    hf = _hf_model("qwen3_moe", norm_topk_prob=True)
    src = _save_hf(hf, tmp_path / "src")
    missing = _corrupt(
        src, tmp_path / "missing", lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    )
    with pytest.raises(
        CheckpointFormatError,
        match=r"missing key 'model.layers.2.mlp.experts.5.up_proj.weight' "
        r"\(expected shape \(32, 64\)\)",
    ):
        dm.from_pretrained(missing)
    extra = _corrupt(
        src, tmp_path / "extra", lambda t: t.update({"model.layers.0.mlp.bonus": torch.zeros(3, 2)})
    )
    with pytest.raises(
        CheckpointFormatError, match=r"unexpected key 'model.layers.0.mlp.bonus' with shape \(3, 2\)"
    ):
        dm.from_pretrained(extra)

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    wrong = _corrupt(src, tmp_path / "wrong", reshape)
    with pytest.raises(
        CheckpointFormatError,
        match=r"key 'model.layers.1.self_attn.k_proj.weight' has shape "
        r"\(16, 64\) in the checkpoint but the model expects \(32, 64\)",
    ):
        dm.from_pretrained(wrong)


def test_unsupported_config_is_refused(tmp_path: Path) -> None:
    hf = _hf_model(
        "qwen3",
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "rope_theta": 1e4,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    path = _save_hf(hf, tmp_path)
    with pytest.raises(ValueError, match="rope_type 'llama3' is not supported"):
        dm.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3"


def test_sequence_classification_matches_hf() -> None:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**COMMON, num_labels=3, pad_token_id=0)  # type: ignore[arg-type]
    hf = transformers.Qwen3ForSequenceClassification(config).eval()
    ours = dm.Qwen3ForSequenceClassification(config_from_hf(config.to_dict()), num_labels=3)
    state = {k: v for k, v in hf.state_dict().items() if k != "score.weight"}
    state["lm_head.weight"] = torch.zeros(VOCAB, 64)
    mapper = hf_to_d9d_mapper(ours.config)
    mapped: dict[str, torch.Tensor] = {}
    for group in mapper.groups():
        mapped |= apply_group(mapper, group, {k: state[k] for k in group.inputs})
    mapped = {k: v for k, v in mapped.items() if not k.startswith("lm_head.")}
    mapped["score.score.weight"] = hf.score.weight.detach()
    ours.load_state_dict(mapped, strict=True)
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, 5:], mask[1, 5:] = 0, 0  # right padding with the pad token, as transformers expects
    labels = torch.tensor([0, 2, 1])
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, labels=labels)
        got = ours(input_ids=ids, attention_mask=mask)["logits"]
        loss = ours(input_ids=ids, attention_mask=mask, labels=labels)["loss"]
    assert _rel_err(got, expected.logits) <= 1e-5
    assert abs(loss.mean().item() - expected.loss.item()) <= 1e-5
