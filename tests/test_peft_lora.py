"""LoRA on dense layers, full-tune and stacking on a tiny d9d Qwen3 (CPU, float32/float64)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter, ValidationError
from torch import nn

import d9d.models as dm
from d9d.models.hf import hf_to_d9d_mapper
from d9d.peft import (
    FullTune,
    FullTuneConfig,
    LoRA,
    LoRAConfig,
    LoRALinear,
    PeftConfig,
    Stack,
    StackConfig,
    base_view,
    build_peft_method,
    check_targets_match,
    inject_and_freeze,
    merge,
    merged,
    reset_adapters,
)
from d9d.state import load_model_state

CONFIG = dm.Qwen3Config(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    attention_backend="eager",
    initializer_range=0.1,
)
ATTN_AND_DOWN = r".*\.(q_proj|v_proj|down_proj)"


def _model(seed: int = 0) -> dm.Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return dm.Qwen3ForCausalLM(CONFIG)


def _ids() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))


def _logits(model: nn.Module) -> torch.Tensor:
    out: torch.Tensor = model(input_ids=_ids())["logits"]
    return out


def _randomize_b(model: nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)


def test_lora_linear_matches_a_float64_reference() -> None:
    torch.manual_seed(0)
    base = nn.Linear(12, 7, dtype=torch.float64)
    weight, bias = base.weight.detach().clone(), base.bias.detach().clone()
    lora = LoRALinear(base, rank=3, alpha=6.0)
    assert lora.weight is base.weight and lora.bias is base.bias  # adopted, not copied
    assert list(lora.state_dict()) == ["weight", "bias", "lora_A", "lora_B"]
    assert torch.equal(lora.lora_B, torch.zeros(7, 3, dtype=torch.float64))
    with torch.no_grad():
        lora.lora_B.normal_()
    x = torch.randn(5, 12, dtype=torch.float64)
    a, b = lora.lora_A.detach(), lora.lora_B.detach()
    expected = x @ weight.T + bias + (6.0 / 3) * (x @ a.T @ b.T)
    torch.testing.assert_close(lora(x), expected, rtol=1e-12, atol=1e-12)
    folded = lora.merged_module()
    assert type(folded) is nn.Linear and folded is base
    torch.testing.assert_close(folded(x), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(lora.weight, weight)  # merging into a new tensor left the adapted layer alone


def test_injected_model_equals_base_at_init_and_only_lora_gets_gradients() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    result = inject_and_freeze(model, LoRA(LoRAConfig(target_modules=ATTN_AND_DOWN, rank=4)))
    lora_names = {n for n, _ in model.named_parameters() if ".lora_" in n}
    assert len(lora_names) == 2 * 3 * CONFIG.num_layers
    assert result.trainable == lora_names == result.added
    assert torch.equal(_logits(model), _logits(reference))  # B = 0: the update is exactly zero

    out = model(input_ids=_ids(), labels=_ids())
    out["loss"].sum().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == lora_names
    assert {n for n, p in model.named_parameters() if p.requires_grad} == lora_names
    b_grads = [p.grad for n, p in model.named_parameters() if n.endswith("lora_B")]
    assert all(g is not None and g.abs().sum() > 0 for g in b_grads)


def test_merge_equals_the_adapted_model_and_restores_base_keys() -> None:
    model = _model()
    base_keys = list(model.state_dict())
    base_linear = model.model.layers["0"].self_attn.q_proj
    inject_and_freeze(model, LoRA(LoRAConfig(target_modules=ATTN_AND_DOWN, rank=4, alpha=4.0)))
    _randomize_b(model)
    adapted = _logits(model)
    assert (adapted - _logits(_model())).abs().max() > 1e-2  # the adapter is not trivial

    with merged(model):  # temporary: base structure, folded weights
        assert list(model.state_dict()) == base_keys
        torch.testing.assert_close(_logits(model), adapted, rtol=1e-5, atol=1e-5)
    assert isinstance(model.model.layers["0"].self_attn.q_proj, LoRALinear)
    assert torch.equal(_logits(model), adapted)  # the adapters survived the temporary merge

    merge(model)
    q_proj = model.model.layers["0"].self_attn.q_proj
    assert type(q_proj) is nn.Linear and q_proj is base_linear  # the original module object is back
    assert list(model.state_dict()) == base_keys
    torch.testing.assert_close(_logits(model), adapted, rtol=1e-5, atol=1e-5)


def test_meta_injection_then_base_checkpoint_load(tmp_path: Path) -> None:
    base = _model(seed=3)
    dm.save_pretrained(base, tmp_path / "base")
    with torch.device("meta"):
        model = dm.Qwen3ForCausalLM(CONFIG)
    result = inject_and_freeze(model, LoRA(LoRAConfig(target_modules=ATTN_AND_DOWN, rank=2)))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    with base_view(model):  # exactly the base keys: the base model's own mapper loads strictly
        load_model_state(tmp_path / "base", model, hf_to_d9d_mapper(CONFIG), strict=True)
    reset_adapters(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == result.trainable
    assert torch.equal(_logits(model), _logits(base))
    a = model.model.layers["1"].mlp.down_proj.lora_A
    assert a.abs().max() <= 1 / CONFIG.intermediate_size**0.5 and a.abs().max() > 0


def test_dropout_only_acts_in_training() -> None:
    model = _model()
    reference = _logits(model)
    inject_and_freeze(model, LoRA(LoRAConfig(target_modules=ATTN_AND_DOWN, rank=4, dropout=0.5)))
    _randomize_b(model)
    model.eval()
    evaluated = _logits(model)
    assert not torch.allclose(evaluated, reference)
    model.train()
    assert not torch.allclose(_logits(model), evaluated)
    model.eval()
    assert torch.equal(_logits(model), evaluated)


def test_stack_of_lora_and_full_tune_trains_the_union() -> None:
    model = _model()
    norms = r"model\.norm|model\.layers\.\d+\.input_layernorm"
    config = TypeAdapter(PeftConfig).validate_python(
        {
            "kind": "stack",
            "methods": [
                {"kind": "lora", "target_modules": ATTN_AND_DOWN, "rank": 2},
                {"kind": "full_tune", "target_modules": norms},
            ],
        }
    )
    assert isinstance(config, StackConfig)
    method = build_peft_method(config)
    assert isinstance(method, Stack)
    assert [type(m) for m in method.methods] == [LoRA, FullTune]
    result = inject_and_freeze(model, method)
    lora = {n for n, _ in model.named_parameters() if ".lora_" in n}
    full = {"model.norm.weight"} | {
        f"model.layers.{i}.input_layernorm.weight" for i in range(CONFIG.num_layers)
    }
    assert result.trainable == lora | full and result.added == lora
    model(input_ids=_ids(), labels=_ids())["loss"].sum().backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == lora | full


def test_full_tune_alone_changes_no_structure() -> None:
    model = _model()
    keys = list(model.state_dict())
    result = inject_and_freeze(model, FullTune(FullTuneConfig(target_modules=r"model\.layers\.1\.self_attn")))
    assert list(model.state_dict()) == keys and not result.added
    assert result.trainable == {k for k in keys if k.startswith("model.layers.1.self_attn.")}


def test_configs_and_targets_are_checked() -> None:
    adapter: TypeAdapter[PeftConfig] = TypeAdapter(PeftConfig)
    with pytest.raises(ValidationError, match="not a valid regular expression"):
        adapter.validate_python({"kind": "lora", "target_modules": "q_proj("})
    with pytest.raises(ValidationError, match="rank"):
        adapter.validate_python({"kind": "lora", "target_modules": ".*", "rank": 0})
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        adapter.validate_python({"kind": "ia3", "target_modules": ".*"})
    with pytest.raises(ValidationError, match="methods"):
        adapter.validate_python({"kind": "stack", "methods": []})
    with pytest.raises(ValidationError, match="extra"):
        adapter.validate_python({"kind": "full_tune", "target_modules": ".*", "rank": 3})

    with pytest.raises(
        ValueError, match=r"'q_proj' fully matches no nn.Linear.*model.layers.0.self_attn.q_proj"
    ):
        LoRA(LoRAConfig(target_modules="q_proj")).inject(_model())
    with pytest.raises(ValueError, match="full_tune target_modules 'nothing' fully matches no module"):
        FullTune(FullTuneConfig(target_modules="nothing")).inject(_model())
    twice = StackConfig(
        methods=[LoRAConfig(target_modules=ATTN_AND_DOWN), LoRAConfig(target_modules=r".*q_proj")]
    )
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj already carries an adapter"):
        build_peft_method(twice).inject(_model())


def test_pipeline_stages_may_miss_a_pattern_that_the_whole_model_matches() -> None:
    """`require_match=False` (a pipeline stage) reports what matched nothing instead of raising; across
    the stages of one model only a pattern that matched nowhere is an error, named by its key."""
    from d9d.pipeline.api import PipelineStageInfo

    config = StackConfig(
        methods=[
            LoRAConfig(target_modules=r"model\.layers\.0\.self_attn\.q_proj"),
            FullTuneConfig(target_modules=r"model\.norm"),
        ]
    )
    stages = [dm.Qwen3ForCausalLM(CONFIG, stage=PipelineStageInfo(s, 2)) for s in range(2)]
    results = [inject_and_freeze(m, build_peft_method(config), require_match=False) for m in stages]
    assert [sorted(u.field for u in r.unmatched) for r in results] == [
        ["methods.1.target_modules"],
        ["methods.0.target_modules"],
    ]
    assert results[0].trainable == {
        "model.layers.0.self_attn.q_proj.lora_A",
        "model.layers.0.self_attn.q_proj.lora_B",
    }
    assert results[1].trainable == {"model.norm.weight"}
    check_targets_match(results, "method")
    with pytest.raises(ValueError, match=r"full_tune method\.methods\.1\.target_modules .* in any of 1 "):
        check_targets_match(results[:1], "method")
    # one process: the stack raises every pattern that matched nothing at once, by its index
    typos = StackConfig(methods=[LoRAConfig(target_modules="qproj"), FullTuneConfig(target_modules="nrom")])
    with pytest.raises(
        ValueError,
        match=r"^lora methods\.0\.target_modules 'qproj' fully matches no nn\.Linear .*; "
        r"full_tune methods\.1\.target_modules 'nrom' fully matches no module with parameters; ",
    ):
        build_peft_method(typos).inject(_model())


def test_tied_embeddings_are_one_trainable_parameter() -> None:
    tied = CONFIG.model_copy(update={"tie_word_embeddings": True})
    torch.manual_seed(0)
    model = dm.Qwen3ForCausalLM(tied)
    result = inject_and_freeze(model, FullTune(FullTuneConfig(target_modules=r"model\.embed_tokens|lm_head")))
    assert result.trainable == {"model.embed_tokens.weights.regular", "lm_head.weights.regular"}
    (table,) = result.parameters(model)
    assert table is model.lm_head.weights["regular"] and table.requires_grad  # the head trains with it


def _fail_inside(view: Callable[[nn.Module], AbstractContextManager[None]], model: nn.Module) -> None:
    with view(model):
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        raise RuntimeError("boom")


def test_views_put_the_adapters_back_after_an_error() -> None:
    model = _model()
    inject_and_freeze(model, LoRA(LoRAConfig(target_modules=ATTN_AND_DOWN, rank=2)))
    for view in (base_view, merged):
        with pytest.raises(RuntimeError, match="boom"):
            _fail_inside(view, model)
        assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 3 * CONFIG.num_layers
