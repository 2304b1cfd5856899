"""Hugging Face Qwen3-MoE (`model_type: qwen3_moe`) ⇄ d9d: `config.json` both ways and the state mappers.

Reads transformers v4 (`num_experts`) and v5 (`num_local_experts`) spellings; writes v5's. Experts load from
one module per expert or fused tensors (`CheckpointTraits.expert_layout`). The d9d-only expert bias
(auxiliary-loss-free balancing) has no transformers Qwen3-MoE equivalent: it is written as the extra tensors
`model.layers.<i>.mlp.gate.e_score_correction_bias` (DeepSeek-V3's name, which transformers' Qwen3-MoE
ignores) with `"d9d_expert_bias": true` in `config.json`, and loaded when present (zero otherwise).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from d9d.models.family import EXPERT_BIAS_HF_NAME, CheckpointTraits, ExpertLayout, HuggingFaceFormat
from d9d.models.hf.config import EXPERT_BIAS_CONFIG_KEY
from d9d.models.hf.mappers import (
    embeddings_to_d9d,
    embeddings_to_hf,
    expert_bias_hf_keys,
    expert_bias_to_d9d,
    expert_bias_to_hf,
    experts_mapper,
)
from d9d.models.qwen3.hf import attention_and_norm_keys, common_fields, common_to_hf, dense_layer
from d9d.models.qwen3_moe.config import Qwen3MoEConfig
from d9d.state.mapper import Identity, Parallel, Prefixed, StateMapper


def config_from_hf(hf: Mapping[str, Any], overrides: Mapping[str, Any]) -> Qwen3MoEConfig:
    fields = common_fields(hf) | {
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


def export_gap(config: Qwen3MoEConfig) -> str | None:
    if config.expert_bias:
        return (
            "the model routes with expert_bias (auxiliary-loss-free balancing), which Hugging Face Qwen3-MoE "
            "cannot hold: transformers would route without it, so its logits would differ from d9d's"
        )
    return None


def config_to_hf(config: Qwen3MoEConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    out |= common_to_hf(config)
    windowed = [config.layer_window(i) is not None for i in range(config.num_layers)]
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
    return out | {
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": config.decoder_sparse_step,
        "mlp_only_layers": list(config.mlp_only_layers),
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": config.router_aux_loss_coef > 0,
    }


def moe_layers(config: Qwen3MoEConfig) -> list[int]:
    return [i for i in range(config.num_layers) if config.is_moe_layer(i)]


def _layer(config: Qwen3MoEConfig, index: int, layout: ExpertLayout) -> StateMapper:
    if not config.is_moe_layer(index):
        return dense_layer(config, index)
    plain = Identity([*attention_and_norm_keys(config), "mlp.gate.weight"])
    experts = experts_mapper(config.num_experts, config.moe_intermediate_size, layout)
    return Prefixed(f"model.layers.{index}.", Parallel([plain, experts]))


def to_d9d(config: Qwen3MoEConfig, traits: CheckpointTraits) -> StateMapper:
    return Parallel(
        [
            *(_layer(config, i, traits.expert_layout) for i in range(config.num_layers)),
            Identity(["model.norm.weight"]),
            *embeddings_to_d9d(config.splits, config.tie_word_embeddings, traits),
            *expert_bias_to_d9d(moe_layers(config), config.num_experts, config.expert_bias, traits),
        ]
    )


def to_hf(config: Qwen3MoEConfig, layout: ExpertLayout) -> StateMapper:
    return Parallel(
        [
            *(_layer(config, i, layout).inverse() for i in range(config.num_layers)),
            Identity(["model.norm.weight"]),
            *embeddings_to_hf(config.splits, config.tie_word_embeddings),
            *expert_bias_to_hf(moe_layers(config), config.expert_bias),
        ]
    )


def optional_keys(config: Qwen3MoEConfig) -> list[str]:
    """The expert bias tensors: absent, the bias starts at zero; unwanted, they are dropped."""
    return expert_bias_hf_keys(moe_layers(config))


QWEN3_MOE_HF = HuggingFaceFormat(
    model_types=("qwen3_moe",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    to_d9d=to_d9d,
    to_hf=to_hf,
    export_gap=export_gap,
    optional_keys=optional_keys,
)
