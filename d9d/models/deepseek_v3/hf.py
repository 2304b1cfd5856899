"""Hugging Face DeepSeek-V3 (`model_type: deepseek_v3`, `DeepseekV3ForCausalLM`) ⇄ d9d: `config.json` both
ways and the state mappers.

The expert bias is DeepSeek-V3's own `mlp.gate.e_score_correction_bias` (d9d: `mlp.gate.expert_bias`),
kept both ways; the shared experts are HF `mlp.shared_experts.*` (d9d `mlp.shared_expert.*`); experts
load from one module per expert or fused tensors. RoPE default and YaRN convert. Refused, naming the field:
`num_key_value_heads` other than `num_attention_heads` (MLA has no grouped keys), activations other than
SiLU, attention dropout, other RoPE types.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from d9d.models.deepseek_v3.config import DeepSeekV3Config
from d9d.models.family import CheckpointTraits, ExpertLayout, HuggingFaceFormat
from d9d.models.hf.mappers import (
    EXPERT_PROJECTIONS,
    embeddings_to_d9d,
    embeddings_to_hf,
    expert_bias_hf_keys,
    expert_bias_to_d9d,
    expert_bias_to_hf,
    experts_mapper,
)
from d9d.models.hf.rope import rope_from_hf, rope_to_hf
from d9d.modules.rotary import NoRopeScaling, YarnRopeScaling
from d9d.state.mapper import Function, Identity, Parallel, Prefixed, Rename, StateMapper


def config_from_hf(hf: Mapping[str, Any], overrides: Mapping[str, Any]) -> DeepSeekV3Config:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (DeepSeek-V3 uses 'silu')")
    if hf.get("attention_dropout", 0.0):
        raise ValueError(f"attention_dropout={hf['attention_dropout']} is not supported")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ValueError(
            f"num_key_value_heads={kv_heads} differs from num_attention_heads={heads}: multi-head latent "
            "attention expands keys and values for every head"
        )
    max_positions = hf.get("max_position_embeddings", 4096)
    theta, scaling = rope_from_hf(hf, max_positions)
    if not isinstance(scaling, NoRopeScaling | YarnRopeScaling):
        raise ValueError(f"rope_type {scaling.kind!r} is not supported for DeepSeek-V3 (default, yarn)")
    fields = {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_attention_heads": heads,
        "q_lora_rank": hf.get("q_lora_rank"),
        "kv_lora_rank": hf["kv_lora_rank"],
        "qk_nope_head_dim": hf["qk_nope_head_dim"],
        "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
        "intermediate_size": hf["intermediate_size"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "num_experts": hf.get("n_routed_experts") or hf["num_local_experts"],
        "num_shared_experts": hf.get("n_shared_experts") or 0,
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "num_expert_groups": hf.get("n_group") or 1,
        "topk_groups": hf.get("topk_group") or 1,
        "routed_scaling_factor": hf.get("routed_scaling_factor", 1.0),
        "norm_topk_prob": hf.get("norm_topk_prob", True),
        "first_k_dense": hf.get("first_k_dense_replace", 0),
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_interleave": hf.get("rope_interleave", True),
        "max_position_embeddings": max_positions,
        "attention_bias": hf.get("attention_bias", False),
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "initializer_range": hf.get("initializer_range", 0.02),
    }
    return DeepSeekV3Config(**{**fields, **overrides})


def config_to_hf(config: DeepSeekV3Config) -> dict[str, Any]:
    """The `config.json` content transformers needs to rebuild `config`."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "intermediate_size": config.intermediate_size,
        "moe_intermediate_size": config.moe_intermediate_size,
        "n_routed_experts": config.num_experts,
        "n_shared_experts": config.num_shared_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "n_group": config.num_expert_groups,
        "topk_group": config.topk_groups,
        "routed_scaling_factor": config.routed_scaling_factor,
        "norm_topk_prob": config.norm_topk_prob,
        "first_k_dense_replace": config.first_k_dense,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": rope_to_hf(config.rope_theta, config.rope_scaling, config.max_position_embeddings),
        "rope_interleave": config.rope_interleave,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "num_nextn_predict_layers": 0,
    }


def _attention_keys(config: DeepSeekV3Config) -> list[str]:
    if config.q_lora_rank is None:
        keys = ["self_attn.q_proj.weight"]
    else:
        keys = ["self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"]
        keys += ["self_attn.q_a_proj.bias"] if config.attention_bias else []
    keys += [
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.kv_b_proj.weight",
    ]
    keys += ["self_attn.o_proj.weight"]
    if config.attention_bias:
        keys += ["self_attn.kv_a_proj_with_mqa.bias", "self_attn.o_proj.bias"]
    return [*keys, "input_layernorm.weight", "post_attention_layernorm.weight"]


def _layer(config: DeepSeekV3Config, index: int, layout: ExpertLayout) -> StateMapper:
    """One layer's HF keys (unprefixed inside) → d9d keys."""
    plain = _attention_keys(config)
    if not config.is_moe_layer(index):
        mapper: StateMapper = Identity([*plain, *(f"mlp.{p}.weight" for p in EXPERT_PROJECTIONS)])
        return Prefixed(f"model.layers.{index}.", mapper)
    parts: list[StateMapper] = [
        Identity([*plain, "mlp.gate.weight"]),
        experts_mapper(config.num_experts, config.moe_intermediate_size, layout),
    ]
    if config.num_shared_experts:
        parts.append(
            Rename(
                {
                    f"mlp.shared_experts.{p}.weight": f"mlp.shared_expert.{p}.weight"
                    for p in EXPERT_PROJECTIONS
                }
            )
        )
    return Prefixed(f"model.layers.{index}.", Parallel(parts))


def moe_layers(config: DeepSeekV3Config) -> list[int]:
    return [i for i in range(config.num_layers) if config.is_moe_layer(i)]


def to_d9d(config: DeepSeekV3Config, traits: CheckpointTraits) -> StateMapper:
    """HF checkpoint keys → the keys of a whole d9d causal-LM model. The expert bias loads from
    `e_score_correction_bias` (zero when absent, dropped when the config disables it)."""
    return Parallel(
        [
            *(_layer(config, i, traits.expert_layout) for i in range(config.num_layers)),
            Identity(["model.norm.weight"]),
            *embeddings_to_d9d(config.splits, config.tie_word_embeddings, traits),
            *expert_bias_to_d9d(moe_layers(config), config.num_experts, config.expert_bias, traits),
        ]
    )


def to_hf(config: DeepSeekV3Config, layout: ExpertLayout) -> StateMapper:
    """d9d keys → HF keys; without a d9d expert bias the checkpoint gets zero biases (what HF routes with)."""
    layers = moe_layers(config)
    parts = [
        *(_layer(config, i, layout).inverse() for i in range(config.num_layers)),
        Identity(["model.norm.weight"]),
        *embeddings_to_hf(config.splits, config.tie_word_embeddings),
        *expert_bias_to_hf(layers, config.expert_bias),
    ]
    if not config.expert_bias and layers:
        keys, experts = expert_bias_hf_keys(layers), config.num_experts
        parts.append(
            Function([], keys, lambda _: {k: torch.zeros(experts) for k in keys}, name="ZeroExpertBias")
        )
    return Parallel(parts)


def optional_keys(config: DeepSeekV3Config) -> list[str]:
    """The expert bias tensors: absent, the bias starts at zero."""
    return expert_bias_hf_keys(moe_layers(config))


DEEPSEEK_V3_HF = HuggingFaceFormat(
    model_types=("deepseek_v3",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    to_d9d=to_d9d,
    to_hf=to_hf,
    optional_keys=optional_keys,
)
