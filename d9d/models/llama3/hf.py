"""Hugging Face Llama (`model_type: llama`, `LlamaForCausalLM`) ⇄ d9d Llama 3: `config.json` both ways and
the state mappers (the parameter names are the same; only vocabulary splits and a tied head differ).

RoPE types default, llama3, linear, dynamic and yarn convert; anything d9d cannot reproduce exactly (an MLP
bias, `pretraining_tp` > 1, another activation, attention dropout, partial rotary) is refused, naming the
field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from d9d.models.family import CheckpointTraits, ExpertLayout, HuggingFaceFormat
from d9d.models.hf.mappers import embeddings_to_d9d, embeddings_to_hf
from d9d.models.hf.rope import rope_from_hf, rope_parameters, rope_to_hf
from d9d.models.llama3.config import Llama3Config
from d9d.models.llama3.rope import Llama3RopeScaling
from d9d.state.mapper import Identity, Parallel, StateMapper


def config_from_hf(hf: Mapping[str, Any], overrides: Mapping[str, Any]) -> Llama3Config:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (Llama uses 'silu')")
    if hf.get("attention_dropout", 0.0):
        raise ValueError(f"attention_dropout={hf['attention_dropout']} is not supported")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (Llama 3's MLP has no bias)")
    if hf.get("pretraining_tp", 1) != 1:
        raise ValueError(
            f"pretraining_tp={hf['pretraining_tp']} is not supported (it changes the matmul order)"
        )
    max_positions = hf.get("max_position_embeddings", 8192)
    params = rope_parameters(hf)
    if params["rope_type"] == "llama3":
        theta = float(params["rope_theta"])
        scaling: Any = Llama3RopeScaling(
            factor=params["factor"],
            low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position_embeddings=params["original_max_position_embeddings"],
        )
    else:
        theta, scaling = rope_from_hf(hf, max_positions)
    heads = hf["num_attention_heads"]
    fields = {
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
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "initializer_range": hf.get("initializer_range", 0.02),
    }
    return Llama3Config(**{**fields, **overrides})


def config_to_hf(config: Llama3Config) -> dict[str, Any]:
    """The `config.json` content transformers needs to rebuild `config`."""
    scaling = config.rope_scaling
    if isinstance(scaling, Llama3RopeScaling):
        rope = {
            "rope_theta": config.rope_theta,
            "rope_type": "llama3",
            **scaling.model_dump(exclude={"kind"}),
        }
    else:
        rope = rope_to_hf(config.rope_theta, scaling, config.max_position_embeddings)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
    }


def layer_keys(config: Llama3Config, index: int) -> list[str]:
    """A layer's keys, the same in both formats."""
    attention = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if config.attention_bias:
        attention += [f"self_attn.{p}_proj.bias" for p in "qkvo"]
    mlp = [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    names = [*attention, *mlp, "input_layernorm.weight", "post_attention_layernorm.weight"]
    return [f"model.layers.{index}.{name}" for name in names]


def _body(config: Llama3Config) -> StateMapper:
    keys = [k for i in range(config.num_layers) for k in layer_keys(config, i)]
    return Identity([*keys, "model.norm.weight"])


def to_d9d(config: Llama3Config, traits: CheckpointTraits) -> StateMapper:
    """HF checkpoint keys → the keys of a whole d9d causal-LM model (narrow it per stage with `Select`)."""
    return Parallel([_body(config), *embeddings_to_d9d(config.splits, config.tie_word_embeddings, traits)])


def to_hf(config: Llama3Config, layout: ExpertLayout) -> StateMapper:
    return Parallel([_body(config), *embeddings_to_hf(config.splits, config.tie_word_embeddings)])


LLAMA3_HF = HuggingFaceFormat(
    model_types=("llama",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    to_d9d=to_d9d,
    to_hf=to_hf,
)
