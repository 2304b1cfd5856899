"""`model.options.export_adapters` needs a LoRA method: the Hugging Face `peft` layout holds LoRA adapters
(full-tuned parameters only ride along as `modules_to_save`). A method without one is refused when the
config is validated, before any process starts, instead of after the whole run when the adapter export
finds nothing to write."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from d9d.engine.config import ConfigError, parse_config
from d9d.engine.registry import PeftModel

ARCH = {
    "vocab_size": 32,
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "tie_word_embeddings": False,
}
NORM = {"kind": "full_tune", "target_modules": r"model\.norm"}
LAYER_0 = {"kind": "full_tune", "target_modules": r"model\.layers\.0"}
LORA = {"kind": "lora", "target_modules": r".*\.(q_proj|v_proj)", "rank": 4}


def _job(tmp: Path, method: dict[str, Any], export_adapters: bool) -> dict[str, Any]:
    return {
        "run": {"name": "peft-export", "dir": str(tmp / "run")},
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": 4},
        "checkpointing": {"export_hf_dir": str(tmp / "export")},
        "model": {
            "provider": "peft",
            "options": {
                "base": {"provider": "qwen3", "options": {"architecture": ARCH}},
                "method": method,
                "export_adapters": export_adapters,
            },
        },
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "sgd", "options": {"lr": 0.1}},
    }


@pytest.mark.parametrize(
    ("method", "kinds"),
    [
        (NORM, "full_tune"),
        ({"kind": "stack", "methods": [NORM, LAYER_0]}, "stack of full_tune, full_tune"),
        ({"kind": "stack", "methods": [{"kind": "stack", "methods": [NORM]}]}, "stack of stack of full_tune"),
    ],
)
def test_export_adapters_without_a_lora_method_is_refused_at_config_time(
    tmp_path: Path, method: dict[str, Any], kinds: str
) -> None:
    expected = (
        re.escape("model.options.export_adapters: ")
        + ".*"
        + re.escape(
            "the Hugging Face peft adapter layout needs LoRA adapters, and method "
            f"({kinds}) has no lora method"
        )
    )
    with pytest.raises(ConfigError, match=expected):
        parse_config(_job(tmp_path, method, export_adapters=True))


@pytest.mark.parametrize(
    "method",
    [
        LORA,
        {"kind": "stack", "methods": [NORM, LORA]},
        {"kind": "stack", "methods": [{"kind": "stack", "methods": [LORA]}]},
    ],
)
def test_export_adapters_with_a_lora_method_is_accepted(tmp_path: Path, method: dict[str, Any]) -> None:
    config = parse_config(_job(tmp_path, method, export_adapters=True))
    assert isinstance(config.model, PeftModel) and config.model.options.export_adapters


def test_full_tune_without_export_adapters_is_accepted(tmp_path: Path) -> None:
    config = parse_config(_job(tmp_path, NORM, export_adapters=False))
    assert isinstance(config.model, PeftModel) and not config.model.options.export_adapters
