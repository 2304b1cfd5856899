"""Hugging Face `config.json` ⇄ d9d model configs for Qwen3 (`qwen3`) and Qwen3-MoE (`qwen3_moe`).

Reads both transformers v4 (`rope_theta` + `rope_scaling`, `num_experts`) and v5 (`rope_parameters`,
`num_local_experts`) spellings; writes the v5 spelling. Anything d9d cannot reproduce exactly is refused
with the offending field named, never silently approximated.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from d9d.models.qwen3 import Qwen3Config
from d9d.models.qwen3_moe import Qwen3MoEConfig
from d9d.modules.rotary import (
    DynamicNTKRopeScaling,
    LinearRopeScaling,
    NoRopeScaling,
    RopeScaling,
    YarnRopeScaling,
)

# The d9d-only expert bias in Hugging Face files: one extra tensor per MoE layer, under DeepSeek-V3's name
# for the same thing, and a config.json flag so a reload turns the bias on.
EXPERT_BIAS_HF_NAME = "mlp.gate.e_score_correction_bias"
EXPERT_BIAS_CONFIG_KEY = "d9d_expert_bias"

MODEL_TYPES = ("qwen3", "qwen3_moe")


def _rope_from_hf(hf: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling]:
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"rope_parameters per layer type are not supported: {sorted(params)}")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported (d9d rotates the whole head)")
    if kind == "default":
        return theta, NoRopeScaling()
    if kind == "linear":
        return theta, LinearRopeScaling(factor=params["factor"])
    if kind == "dynamic":
        # Hugging Face stretches relative to max_position_embeddings
        return theta, DynamicNTKRopeScaling(
            factor=params["factor"], original_max_position_embeddings=max_positions
        )
    if kind == "yarn":
        original = params.get("original_max_position_embeddings") or max_positions
        factor = params.get("factor") or max_positions / original
        return theta, YarnRopeScaling(
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=params.get("truncate", True),
        )
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, dynamic, yarn)")


def _rope_to_hf(config: Qwen3Config) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": config.rope_theta}
    scaling = config.rope_scaling
    if isinstance(scaling, NoRopeScaling):
        return {**params, "rope_type": "default"}
    if isinstance(scaling, LinearRopeScaling):
        return {**params, "rope_type": "linear", "factor": scaling.factor}
    if isinstance(scaling, DynamicNTKRopeScaling):
        if scaling.original_max_position_embeddings != config.max_position_embeddings:
            raise ValueError(
                "Hugging Face dynamic RoPE scales relative to max_position_embeddings="
                f"{config.max_position_embeddings}, but original_max_position_embeddings="
                f"{scaling.original_max_position_embeddings}"
            )
        return {**params, "rope_type": "dynamic", "factor": scaling.factor}
    return {
        **params,
        "rope_type": "yarn",
        **scaling.model_dump(exclude={"kind"}, exclude_none=True),
    }


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> Qwen3Config:
    """A `Qwen3Config` / `Qwen3MoEConfig` from a parsed `config.json`; `overrides` set d9d-only fields
    (e.g. `attention_backend`, `vocab_splits`, `expert_bias`) or replace converted ones."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (Qwen3 uses 'silu')")
    if hf.get("attention_dropout", 0.0):
        raise ValueError(f"attention_dropout={hf['attention_dropout']} is not supported")
    heads = hf["num_attention_heads"]
    layers = hf["num_hidden_layers"]
    max_positions = hf.get("max_position_embeddings", 32768)
    theta, scaling = _rope_from_hf(hf, max_positions)
    sliding_window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    sliding_layers: tuple[int, ...] | None = None
    if sliding_window is not None and model_type == "qwen3":
        types = hf.get("layer_types") or [
            "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(layers)
        ]
        sliding_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    fields: dict[str, Any] = {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": layers,
        "num_attention_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "intermediate_size": hf["intermediate_size"],
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": max_positions,
        "attention_bias": hf.get("attention_bias", False),
        "sliding_window": sliding_window,
        "sliding_window_layers": sliding_layers,
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "initializer_range": hf.get("initializer_range", 0.02),
    }
    if model_type == "qwen3":
        return Qwen3Config(**{**fields, **overrides})
    fields |= {
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "num_experts": hf.get("num_experts") or hf["num_local_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "norm_topk_prob": hf.get("norm_topk_prob", False),
        "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
        # transformers adds the balancing loss only when output_router_logits is set
        "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001)
        if hf.get("output_router_logits")
        else 0.0,
        # written by d9d's export next to the bias tensors (transformers ignores both)
        "expert_bias": bool(hf.get(EXPERT_BIAS_CONFIG_KEY, False)),
    }
    return Qwen3MoEConfig(**{**fields, **overrides})


def hf_export_gap(config: Qwen3Config) -> str | None:
    """Why transformers would compute different logits from a Hugging Face export of `config` (a part of
    the model its format cannot hold), or None when the export is exact."""
    if isinstance(config, Qwen3MoEConfig) and config.expert_bias:
        return (
            "the model routes with expert_bias (auxiliary-loss-free balancing), which Hugging Face Qwen3-MoE "
            "cannot hold: transformers would route without it, so its logits would differ from d9d's"
        )
    return None


def config_to_hf(config: Qwen3Config) -> dict[str, Any]:
    """The `config.json` content transformers needs to rebuild `config`."""
    if config.rope_style != "half":
        raise ValueError(
            f"rope_style={config.rope_style!r} has no Hugging Face Qwen3 equivalent (only 'half')"
        )
    moe = isinstance(config, Qwen3MoEConfig)
    out: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": _rope_to_hf(config),
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
    }
    windowed = [config.layer_window(i) is not None for i in range(config.num_layers)]
    if isinstance(config, Qwen3MoEConfig):
        if any(windowed) and not all(windowed):
            raise ValueError("Hugging Face Qwen3-MoE applies sliding_window to every layer, not to a subset")
        if config.router_score_function != "softmax":
            raise ValueError(
                f"router_score_function={config.router_score_function!r}: Hugging Face Qwen3-MoE routes "
                "with a softmax only"
            )
        if config.expert_bias:
            warnings.warn(
                "expert_bias (auxiliary-loss-free balancing) has no Hugging Face Qwen3-MoE equivalent: it is "
                f"saved as the extra tensors model.layers.<i>.{EXPERT_BIAS_HF_NAME} and d9d reloads it, but "
                "transformers will route without it",
                stacklevel=3,
            )
            out[EXPERT_BIAS_CONFIG_KEY] = True
        out |= {
            "moe_intermediate_size": config.moe_intermediate_size,
            "num_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "norm_topk_prob": config.norm_topk_prob,
            "decoder_sparse_step": config.decoder_sparse_step,
            "mlp_only_layers": list(config.mlp_only_layers),
            "router_aux_loss_coef": config.router_aux_loss_coef,
            "output_router_logits": config.router_aux_loss_coef > 0,
        }
    elif any(windowed):
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windowed]
        out["max_window_layers"] = windowed.index(True)
    return out
