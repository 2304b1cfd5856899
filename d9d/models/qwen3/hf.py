"""Hugging Face Qwen3 (`model_type: qwen3`) ⇄ d9d: `config.json` both ways and the state mappers.

Reads both transformers v4 and v5 spellings; writes the v5 spelling. Anything d9d cannot reproduce exactly is
refused with the offending field named, never silently approximated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from d9d.models.family import CheckpointTraits, ExpertLayout, HuggingFaceFormat
from d9d.models.hf.mappers import EXPERT_PROJECTIONS, embeddings_to_d9d, embeddings_to_hf
from d9d.models.hf.rope import rope_from_hf, rope_to_hf
from d9d.models.qwen3.config import Qwen3Config
from d9d.state.mapper import Identity, Parallel, Prefixed, StateMapper


def common_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The d9d fields Qwen3 and Qwen3-MoE read alike (no sliding-window layers: they differ)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (Qwen3 uses 'silu')")
    if hf.get("attention_dropout", 0.0):
        raise ValueError(f"attention_dropout={hf['attention_dropout']} is not supported")
    heads = hf["num_attention_heads"]
    max_positions = hf.get("max_position_embeddings", 32768)
    theta, scaling = rope_from_hf(hf, max_positions)
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "intermediate_size": hf["intermediate_size"],
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": max_positions,
        "attention_bias": hf.get("attention_bias", False),
        "sliding_window": hf.get("sliding_window") if hf.get("use_sliding_window") else None,
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "initializer_range": hf.get("initializer_range", 0.02),
    }


def config_from_hf(hf: Mapping[str, Any], overrides: Mapping[str, Any]) -> Qwen3Config:
    fields = common_fields(hf)
    if fields["sliding_window"] is not None:
        types = hf.get("layer_types") or [
            "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(fields["num_layers"])
        ]
        fields["sliding_window_layers"] = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return Qwen3Config(**{**fields, **overrides})


def common_to_hf(config: Qwen3Config) -> dict[str, Any]:
    if config.rope_style != "half":
        raise ValueError(
            f"rope_style={config.rope_style!r} has no Hugging Face Qwen3 equivalent (only 'half')"
        )
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope_to_hf(config.rope_theta, config.rope_scaling, config.max_position_embeddings),
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
    }


def config_to_hf(config: Qwen3Config) -> dict[str, Any]:
    """The `config.json` content transformers needs to rebuild `config`."""
    out = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common_to_hf(config)}
    windowed = [config.layer_window(i) is not None for i in range(config.num_layers)]
    if any(windowed):
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windowed]
        out["max_window_layers"] = windowed.index(True)
    return out


def attention_and_norm_keys(config: Qwen3Config) -> list[str]:
    """A layer's attention and norm keys, the same in both formats."""
    keys = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    ]
    if config.attention_bias:
        keys += [f"self_attn.{p}_proj.bias" for p in "qkvo"]
    return [*keys, "input_layernorm.weight", "post_attention_layernorm.weight"]


def dense_layer(config: Qwen3Config, index: int) -> StateMapper:
    plain = attention_and_norm_keys(config) + [f"mlp.{p}.weight" for p in EXPERT_PROJECTIONS]
    return Prefixed(f"model.layers.{index}.", Identity(plain))


def to_d9d(config: Qwen3Config, traits: CheckpointTraits) -> StateMapper:
    """HF checkpoint keys → the keys of a whole d9d causal-LM model (narrow it per stage with `Select`)."""
    layers = [dense_layer(config, i) for i in range(config.num_layers)]
    return Parallel(
        [
            *layers,
            Identity(["model.norm.weight"]),
            *embeddings_to_d9d(config.splits, config.tie_word_embeddings, traits),
        ]
    )


def to_hf(config: Qwen3Config, layout: ExpertLayout) -> StateMapper:
    layers = [dense_layer(config, i).inverse() for i in range(config.num_layers)]
    return Parallel(
        [
            *layers,
            Identity(["model.norm.weight"]),
            *embeddings_to_hf(config.splits, config.tie_word_embeddings),
        ]
    )


QWEN3_HF = HuggingFaceFormat(
    model_types=("qwen3",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    to_d9d=to_d9d,
    to_hf=to_hf,
)
