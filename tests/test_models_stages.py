"""Pipeline stage splits, late initialization and activation checkpointing of the catalogue models."""

from __future__ import annotations

import math

import pytest
import torch

import d9d.models as dm
from d9d.pipeline.api import PipelineStageInfo, PipelineStageModel, TensorMeta

DENSE = {
    "vocab_size": 200,
    "hidden_size": 64,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "initializer_range": 0.1,
}
MOE = {
    **DENSE,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "mlp_only_layers": (2,),
}


def _config(kind: str, **extra: object) -> dm.Qwen3Config:
    if kind == "qwen3":
        return dm.Qwen3Config(**{**DENSE, **extra})  # type: ignore[arg-type]
    return dm.Qwen3MoEConfig(**{**MOE, "router_aux_loss_coef": 0.01, **extra})  # type: ignore[arg-type]


def _causal_lm(config: dm.Qwen3Config, stage: PipelineStageInfo | None = None) -> dm.Qwen3ForCausalLM:
    cls = dm.Qwen3MoEForCausalLM if isinstance(config, dm.Qwen3MoEConfig) else dm.Qwen3ForCausalLM
    return cls(config, stage)


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return {
        "input_ids": ids,
        "position_ids": torch.arange(9).expand(2, 9),
        "attention_mask": mask,
        "labels": torch.randint(0, 200, (2, 9), generator=gen),
    }


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("with_labels", [False, True])
def test_chained_stages_reproduce_the_whole_model(kind: str, num_stages: int, with_labels: bool) -> None:
    torch.manual_seed(0)
    config = _config(kind)
    full = _causal_lm(config)
    state = full.state_dict()
    batch = _batch()
    if not with_labels:
        batch.pop("labels")
    expected = full(**batch)

    held: list[int] = []
    sent: dict[str, torch.Tensor] = {}
    for s in range(num_stages):
        stage = _causal_lm(config, PipelineStageInfo(s, num_stages))
        assert isinstance(stage, PipelineStageModel)
        own = stage.state_dict()
        assert own.keys() <= state.keys()
        stage.load_state_dict({k: state[k] for k in own}, strict=True)
        held += list(stage.model.layer_range)
        meta = stage.stage_output_meta(batch)
        out = stage(**batch, **sent)
        if s < num_stages - 1:
            assert out.keys() == {"hidden_states"}
            assert meta == {
                "hidden_states": TensorMeta(tuple(out["hidden_states"].shape), out["hidden_states"].dtype)
            }
            sent = out
        else:
            assert meta == {}
    assert held == list(range(config.num_layers))
    assert out.keys() == expected.keys()
    for key in expected:
        assert torch.equal(out[key], expected[key]), key


def test_stage_holds_only_its_parts() -> None:
    config = _config("qwen3_moe")
    first, middle, last = (_causal_lm(config, PipelineStageInfo(s, 3)) for s in range(3))
    assert first.model.embed_tokens is not None and first.lm_head is None and first.model.norm is None
    assert middle.model.embed_tokens is None and middle.lm_head is None
    assert last.model.norm is not None and last.lm_head is not None
    keys = [set(m.state_dict()) for m in (first, middle, last)]
    assert not (keys[0] & keys[1]) and not (keys[1] & keys[2]) and not (keys[0] & keys[2])
    with pytest.raises(ValueError, match="pipeline stage 1 needs hidden_states"):
        middle(input_ids=torch.zeros(1, 3, dtype=torch.long))


def test_tied_embeddings_across_stages_are_refused() -> None:
    config = _config("qwen3", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="split over 2 pipeline stages"):
        _causal_lm(config, PipelineStageInfo(1, 2))


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_meta_build_allocates_nothing_then_initializes_with_scaled_std(kind: str) -> None:
    config = _config(
        kind,
        num_layers=8,
        hidden_size=128,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=16,
        initializer_range=0.02,
        tie_word_embeddings=kind == "qwen3",
    )
    with torch.device("meta"):
        model = _causal_lm(config)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert all(t.is_meta for t in tensors.values())

    model.to_empty(device="cpu")
    model.reset_parameters()
    out_std = 0.02 / math.sqrt(2 * config.num_layers)
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        if "norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            expected = (
                out_std if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")) else 0.02
            )
            assert param.std().item() == pytest.approx(expected, rel=0.1), name
    if kind == "qwen3":
        assert model.lm_head is not None and model.model.embed_tokens is not None
        assert model.lm_head.weights["regular"] is model.model.embed_tokens.weights["regular"]
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, torch.zeros_like(buffer)), name
    batch = _batch()
    assert torch.isfinite(model(**batch)["loss"]).all()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_activation_checkpointing_changes_nothing_but_memory(kind: str) -> None:
    torch.manual_seed(0)
    config = _config(kind)
    plain = _causal_lm(config)
    ckpt = _causal_lm(config)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.model.set_activation_checkpointing(layers=[0, 1, 3])
    batch = _batch()
    for model in (plain, ckpt):
        model(**batch)["loss"].sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
    for (name, a), (_, b) in zip(plain.named_buffers(), ckpt.named_buffers(), strict=True):
        assert torch.equal(a, b), name  # MoE loads were counted once despite the recomputation
    with pytest.raises(ValueError, match=r"layers \[7\] are not on this stage"):
        ckpt.model.set_activation_checkpointing(layers=[7])


def test_moe_statistics_and_aux_loss_are_exposed() -> None:
    torch.manual_seed(0)
    config = _config("qwen3_moe", expert_bias=True, expert_bias_update_rate=0.1)
    model = _causal_lm(config)
    batch = _batch()
    model(**batch)["loss"].sum().backward()
    moe_layers = {i: layer.mlp for i, layer in model.model.decoder_layers().items() if i != 2}
    assert set(moe_layers) == {0, 1, 3}
    tokens = int(batch["attention_mask"].sum())  # the real tokens: padding is not load
    for layer in moe_layers.values():
        assert layer.gate.expert_load.sum().item() == tokens * config.num_experts_per_tok
        assert layer.last_aux_loss is not None and layer.last_aux_loss.item() >= 1.0 - 1e-6
        load = layer.gate.expert_load.float()  # int64 counts
        layer.gate.update_expert_bias()
        assert layer.gate.expert_bias is not None
        torch.testing.assert_close(layer.gate.expert_bias, 0.1 * torch.sign(load.mean() - load))


def test_classification_and_embedding_models() -> None:
    torch.manual_seed(0)
    config = _config("qwen3_moe")
    batch = _batch()
    cls = dm.Qwen3MoEForSequenceClassification(config, num_labels=5)
    logits = cls(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["logits"]
    assert logits.shape == (2, 5)
    emb = dm.Qwen3MoEForEmbedding(config, pooling="mean", projection_dim=12)
    out = emb(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["embeddings"]
    assert out.shape == (2, 12)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(2))
    first = dm.Qwen3ForEmbedding(_config("qwen3"), PipelineStageInfo(0, 2))
    assert first(input_ids=batch["input_ids"]).keys() == {"hidden_states"}


def test_config_validation_names_fields() -> None:
    with pytest.raises(ValueError, match="num_attention_heads=6 must be a multiple of num_kv_heads=4"):
        dm.Qwen3Config(**{**DENSE, "num_attention_heads": 6, "num_kv_heads": 4})
    with pytest.raises(ValueError, match=r"vocab_splits .* sum to 150, not vocab_size=200"):
        dm.Qwen3Config(**DENSE, vocab_splits={"regular": 100, "special": 50})
    with pytest.raises(ValueError, match="num_experts_per_tok=5 exceeds num_experts=4"):
        dm.Qwen3MoEConfig(**{**MOE, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="extra"):
        dm.Qwen3Config(**DENSE, unknown_field=1)  # type: ignore[call-arg]


def test_vocab_splits_train_separately() -> None:
    torch.manual_seed(0)
    config = _config("qwen3", vocab_splits={"regular": 190, "special": 10}, tie_word_embeddings=True)
    model = _causal_lm(config)
    assert model.model.embed_tokens is not None
    model.model.embed_tokens.weights["regular"].requires_grad_(False)
    batch = _batch()
    batch["input_ids"][0, :3] = torch.tensor([190, 195, 199])
    model(**batch)["loss"].sum().backward()
    assert model.model.embed_tokens.weights["regular"].grad is None
    special = model.model.embed_tokens.weights["special"].grad
    assert special is not None and special.abs().sum() > 0


@pytest.mark.gpu
def test_cuda_bf16_model_with_auto_backends_tracks_cpu_float32() -> None:
    """On the GPU `auto` picks the fused kernels (torch grouped mm on sm90+, SDPA flash); the bf16 model
    must stay close to the float32 eager reference."""
    torch.manual_seed(0)
    config = _config("qwen3_moe", attention_backend="auto", grouped_mm="auto")
    reference = _causal_lm(config.model_copy(update={"attention_backend": "eager", "grouped_mm": "eager"}))
    with torch.device("meta"):
        fast = _causal_lm(config)
    fast.to_empty(device="cuda")
    fast.load_state_dict(reference.state_dict())
    fast.to(torch.bfloat16)
    batch = _batch()
    batch.pop("attention_mask")  # plain causal: the flash path
    expected = reference(**{k: v for k, v in batch.items() if k != "labels"})["logits"]
    got = fast(**{k: v.cuda() for k, v in batch.items() if k != "labels"})["logits"].float().cpu()
    assert float((got - expected).abs().max() / expected.abs().max()) < 5e-2
    loss = fast(**{k: v.cuda() for k, v in batch.items()})["loss"]
    loss.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in fast.parameters())
