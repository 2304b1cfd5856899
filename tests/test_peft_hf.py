"""Hugging Face interop of PEFT exports: the `peft` library loads our adapters onto the `transformers`
model, and `transformers` loads our merged weights; both give the adapted d9d model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors import safe_open

import d9d.models as dm
from d9d.models.hf import d9d_to_hf_mapper
from d9d.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FullTuneConfig,
    LoRAConfig,
    PeftConfig,
    StackConfig,
    build_peft_method,
    inject_and_freeze,
    merged,
    save_peft_adapter,
)

VOCAB = 96
HF_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**HF_CONFIG))  # type: ignore[arg-type]
    with torch.no_grad():  # norms at one would hide a full-tuned norm that failed to load
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    return path


def _hf_model(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


def _adapted(hf_dir: Path, config: PeftConfig) -> dm.Qwen3ForCausalLM:
    model = dm.from_pretrained(hf_dir)
    inject_and_freeze(model, build_peft_method(config))
    torch.manual_seed(1)
    with torch.no_grad():  # a trained-looking adapter: B = 0 would make any loader look right
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
            elif param.requires_grad:
                param.mul_(torch.empty_like(param).uniform_(0.5, 1.5))
    return model.eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=_ids())
    logits: torch.Tensor = out["logits"] if isinstance(out, dict) else out.logits
    return logits


def test_peft_loads_our_lora_adapter(hf_dir: Path, tmp_path: Path) -> None:
    model = _adapted(
        hf_dir, LoRAConfig(target_modules=r".*\.(q_proj|v_proj|o_proj|up_proj|down_proj)", rank=4)
    )
    ours = _logits(model)
    base = _logits(_hf_model(hf_dir))
    assert (ours - base).abs().max() > 1e-2  # the adapter changes the output

    save_peft_adapter(
        model, tmp_path / "adapter", d9d_to_hf_mapper(model.config), base_model_name_or_path="tiny"
    )
    with safe_open(str(tmp_path / "adapter" / ADAPTER_WEIGHTS), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight").shape == (4, 32)
        assert f.get_tensor("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight").shape == (32, 4)
    assert len(keys) == 2 * 5 * 2
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16.0 and config["base_model_name_or_path"] == "tiny"

    loaded = peft.PeftModel.from_pretrained(_hf_model(hf_dir), tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(loaded), ours, rtol=1e-5, atol=1e-5)


def test_peft_loads_a_stack_with_two_ranks_and_full_tuned_modules(hf_dir: Path, tmp_path: Path) -> None:
    config = StackConfig(
        methods=[
            LoRAConfig(target_modules=r".*\.(q_proj|k_proj)", rank=4, alpha=8.0),
            LoRAConfig(target_modules=r".*\.down_proj", rank=2, alpha=3.0),
            FullTuneConfig(target_modules=r"model\.norm|model\.layers\.0\.post_attention_layernorm"),
        ]
    )
    model = _adapted(hf_dir, config)
    save_peft_adapter(model, tmp_path / "adapter", d9d_to_hf_mapper(model.config))
    written = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert written["modules_to_save"] == ["model.layers.0.post_attention_layernorm", "model.norm"]
    assert set(written["rank_pattern"].values()) == {2} and len(written["rank_pattern"]) == 2

    loaded = peft.PeftModel.from_pretrained(_hf_model(hf_dir), tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=1e-5, atol=1e-5)


def test_transformers_loads_the_merged_export(hf_dir: Path, tmp_path: Path) -> None:
    model = _adapted(hf_dir, LoRAConfig(target_modules=r".*_proj", rank=4, alpha=4.0))
    with merged(model):
        dm.save_pretrained(model, tmp_path / "merged")
    torch.testing.assert_close(_logits(_hf_model(tmp_path / "merged")), _logits(model), rtol=1e-5, atol=1e-5)


def test_adapter_export_refuses_what_peft_cannot_express(tmp_path: Path) -> None:
    moe = dm.Qwen3MoEConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = dm.Qwen3MoEForCausalLM(moe)
    inject_and_freeze(model, build_peft_method(LoRAConfig(target_modules=r".*experts\.up_proj")))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts is a LoRAGroupedExperts"):
        save_peft_adapter(model, tmp_path / "a", d9d_to_hf_mapper(moe))

    split = dm.Qwen3Config(
        **{**moe.model_dump(include=set(dm.Qwen3Config.model_fields)), "vocab_splits": {"a": 90, "b": 6}}
    )
    dense = dm.Qwen3ForCausalLM(split)
    method = StackConfig(
        methods=[
            LoRAConfig(target_modules=r".*q_proj"),
            FullTuneConfig(target_modules=r"model\.embed_tokens"),
        ]
    )
    inject_and_freeze(dense, build_peft_method(method))
    with pytest.raises(
        ValueError, match=r"full-tuned parameter 'model\.embed_tokens\.weights\.a' has no 1:1 key"
    ):
        save_peft_adapter(dense, tmp_path / "b", d9d_to_hf_mapper(split))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
