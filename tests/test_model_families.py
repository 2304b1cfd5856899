"""The model-family registry: the engine finds families through it (config union, preflight, dry run,
parallel checks, config reference), and a user family plugged in by import path gets what a built-in gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import d9d.models as dm
from d9d.engine.config import parse_config
from d9d.engine.dry_run import dry_run
from d9d.engine.errors import ConfigError
from d9d.engine.preflight import preflight
from d9d.engine.registry import ModelComponent
from d9d.models.family import family_for_model_type, family_of, register_family
from d9d.models.qwen3.family import QWEN3

ARCH = {
    "vocab_size": 259,
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
}


def _job(tmp: Path, model: dict[str, Any], mesh: dict[str, int]) -> dict[str, Any]:
    corpus = tmp / "corpus.txt"
    corpus.write_text("a few words\nand some more\n")
    return {
        "run": {"name": "families", "dir": str(tmp / "run")},
        "batching": {"global_batch_size": 4, "microbatch_size": 1},
        "trainer": {"total_steps": 5},
        "mesh": mesh,
        "model": model,
        "data": {"provider": "text", "options": {"dataset": {"paths": [str(corpus)], "max_length": 16}}},
    }


def test_builtin_families_are_registered_in_catalogue_order() -> None:
    names = [f.name for f in dm.families()]
    assert names[: len(dm.BUILTIN_FAMILIES)] == list(dm.BUILTIN_FAMILIES)
    assert names[:2] == ["qwen3", "qwen3_moe"]
    # the closest config class wins: a Qwen3-MoE config is also a Qwen3Config
    moe = dm.Qwen3MoEConfig(**ARCH, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
    assert family_of(moe).name == "qwen3_moe"
    assert family_of(dm.Qwen3Config(**ARCH)).name == "qwen3"
    assert family_for_model_type("qwen3_moe").name == "qwen3_moe"
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        family_for_model_type("gpt2")


def test_a_family_name_or_model_type_is_registered_once() -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match="already registered"):
        register_family(replace(QWEN3))
    with pytest.raises(ValueError, match=r"reads model_type \['qwen3'\]"):
        register_family(replace(QWEN3, name="qwen3_again"))
    assert register_family(QWEN3) is QWEN3  # the same spec again is a no-op


def test_the_model_section_has_one_member_per_family() -> None:
    import typing

    union = typing.get_args(typing.get_args(ModelComponent)[0])
    tags = [typing.get_args(member)[1].tag for member in union]
    assert tags == [f"provider={name}" for name in dm.BUILTIN_FAMILIES] + ["provider=peft", "provider=plugin"]


def test_a_user_family_plugged_in_by_path_gets_the_builtin_dry_run(tmp_path: Path) -> None:
    """The same architecture as a built-in (`qwen3`) and as a user family's plug-in: the dry run models
    tensor-parallel sharding and activations for both, identically."""
    mesh = {"tensor_parallel": 2, "data_parallel_shard": 2}
    builtin = parse_config(_job(tmp_path, {"provider": "qwen3", "options": {"architecture": ARCH}}, mesh))
    plugin_model = {
        "provider": "tests.model_family_fixtures:ByoQwenProvider",
        "options": {"architecture": {**ARCH, "note": "mine"}},
    }
    plugin = parse_config(_job(tmp_path, plugin_model, mesh))
    want, got = dry_run(builtin), dry_run(plugin)
    assert got.parameters == want.parameters
    (w,), (g,) = want.memory, got.memory
    assert (g.parameters, g.gradients, g.optimizer, g.activations) == (
        w.parameters,
        w.gradients,
        w.optimizer,
        w.activations,
    )
    assert g.activations is not None
    assert not any("not modelled" in note for note in g.notes)
    # an independent count: every matrix (all divide by 2 here) splits over tp, norms stay whole (a model this
    # small stays gathered over fsdp from forward to backward: `auto` under `keep_gathered_gib`)
    h, layers, head_dim = ARCH["hidden_size"], ARCH["num_layers"], ARCH["head_dim"]
    norms = layers * (2 * h + 2 * head_dim) + h  # input/post-attention norms, q/k norms, final norm
    total = sum(p.numel() for p in dm.Qwen3ForCausalLM(dm.Qwen3Config(**ARCH)).parameters())  # type: ignore[arg-type]
    assert g.parameters == 4 * ((total - norms) // 2 + norms)


def test_a_user_family_plugged_in_by_path_gets_the_builtin_preflight(tmp_path: Path) -> None:
    arch = {**ARCH, "num_attention_heads": 6, "num_kv_heads": 3, "head_dim": 8}
    mesh = {"tensor_parallel": 2}
    for model in (
        {"provider": "qwen3", "options": {"architecture": arch}},
        {"provider": "tests.model_family_fixtures:ByoQwenProvider", "options": {"architecture": arch}},
    ):
        config = parse_config(_job(tmp_path, model, mesh))
        with pytest.raises(ConfigError) as error:
            preflight(config)
        assert str(error.value) == (
            "model.options.architecture.num_kv_heads=3 is not divisible by mesh.tensor_parallel=2"
        ), model["provider"]


def test_a_user_family_is_found_by_its_config() -> None:
    from tests.model_family_fixtures import BYO_QWEN, ByoQwenConfig

    config = ByoQwenConfig(**ARCH)  # type: ignore[arg-type]
    assert family_of(config) is BYO_QWEN
    with torch.device("meta"):
        model = BYO_QWEN.build_causal_lm(config, None)
    assert BYO_QWEN.flops_per_token(config, 16) == QWEN3.flops_per_token(dm.Qwen3Config(**ARCH), 16)  # type: ignore[arg-type]
    assert sum(p.numel() for p in model.parameters()) > 0
