"""State mappers between Hugging Face Qwen3 / Qwen3-MoE checkpoints and d9d models.

Differences handled here: vocabulary splits (HF has one table), tied heads, expert weights (HF stores
either one module per expert — transformers v4 and what v5 writes — or fused `[E, 2I, H]` / `[E, H, I]`
tensors in memory, d9d stores `[E, in, out]`), and the d9d-only expert bias (kept as extra tensors
`model.layers.<i>.mlp.gate.e_score_correction_bias`, DeepSeek-V3's name, which transformers ignores).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from d9d.models.hf.config import EXPERT_BIAS_HF_NAME
from d9d.models.qwen3 import Qwen3Config
from d9d.models.qwen3_moe import Qwen3MoEConfig
from d9d.state.mapper import (
    Drop,
    Duplicate,
    Function,
    Identity,
    Parallel,
    Prefixed,
    Rename,
    Sequential,
    Split,
    Stack,
    StateMapper,
    Transpose,
    apply_group,
)

ExpertLayout = Literal["per_expert", "fused"]
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def detect_expert_layout(keys: Iterable[str]) -> ExpertLayout:
    """`fused` when the checkpoint holds `mlp.experts.gate_up_proj` tensors, `per_expert` otherwise."""
    return "fused" if any(k.endswith("mlp.experts.gate_up_proj") for k in keys) else "per_expert"


def _vocab(hf_key: str, d9d_prefix: str, splits: Mapping[str, int]) -> StateMapper:
    names = [f"{d9d_prefix}.weights.{name}" for name in splits]
    if len(names) == 1:
        return Rename({hf_key: names[0]})
    return Split(hf_key, names, dim=0, sizes=list(splits.values()))


def _experts(config: Qwen3MoEConfig, layout: ExpertLayout) -> StateMapper:
    """Per layer, HF expert tensors (unprefixed) → `mlp.experts.{gate,up,down}_proj` as [E, in, out]."""
    ours = [f"mlp.experts.{p}" for p in EXPERT_PROJECTIONS]
    if layout == "fused":
        size = config.moe_intermediate_size
        return Parallel(
            [
                Sequential(
                    [
                        Split("mlp.experts.gate_up_proj", ours[:2], dim=1, sizes=[size, size]),
                        Transpose(ours[:2]),
                    ]
                ),
                Transpose([ours[2]]),  # HF [E, H, I] and ours [E, I, H] share the key name
            ]
        )
    return Parallel(
        [
            Sequential(
                [
                    Stack([f"mlp.experts.{e}.{p}.weight" for e in range(config.num_experts)], target, dim=0),
                    Transpose([target]),
                ]
            )
            for p, target in zip(EXPERT_PROJECTIONS, ours, strict=True)
        ]
    )


def _layer(config: Qwen3Config, index: int, layout: ExpertLayout) -> StateMapper:
    attention = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    ]
    if config.attention_bias:
        attention += [f"self_attn.{p}_proj.bias" for p in "qkvo"]
    plain = [*attention, "input_layernorm.weight", "post_attention_layernorm.weight"]
    parts: list[StateMapper] = []
    if isinstance(config, Qwen3MoEConfig) and config.is_moe_layer(index):
        plain.append("mlp.gate.weight")
        parts.append(_experts(config, layout))
    else:
        plain += [f"mlp.{p}.weight" for p in EXPERT_PROJECTIONS]
    return Prefixed(f"model.layers.{index}.", Parallel([Identity(plain), *parts]))


def _moe_layers(config: Qwen3Config) -> list[int]:
    if not isinstance(config, Qwen3MoEConfig):
        return []
    return [i for i in range(config.num_layers) if config.is_moe_layer(i)]


def expert_bias_hf_keys(config: Qwen3Config) -> list[str]:
    """Where the d9d expert bias of each MoE layer lives in a Hugging Face directory (an extra tensor,
    see `EXPERT_BIAS_HF_NAME`), whether or not `config` enables the bias."""
    return [f"model.layers.{i}.{EXPERT_BIAS_HF_NAME}" for i in _moe_layers(config)]


def has_expert_bias(keys: Iterable[str]) -> bool:
    """Whether a checkpoint's keys carry the expert bias that d9d's export writes."""
    return any(k.endswith(EXPERT_BIAS_HF_NAME) for k in keys)


def _expert_bias_keys(config: Qwen3Config) -> list[str]:
    if not isinstance(config, Qwen3MoEConfig) or not config.expert_bias:
        return []
    return [f"model.layers.{i}.mlp.gate.expert_bias" for i in _moe_layers(config)]


def _body(config: Qwen3Config, layout: ExpertLayout) -> list[StateMapper]:
    return [_layer(config, i, layout) for i in range(config.num_layers)] + [Identity(["model.norm.weight"])]


def hf_to_d9d_mapper(
    config: Qwen3Config,
    *,
    expert_layout: ExpertLayout = "per_expert",
    checkpoint_has_lm_head: bool = True,
    checkpoint_has_expert_bias: bool = False,
) -> StateMapper:
    """HF checkpoint keys → the keys of a whole d9d causal-LM model (narrow it per stage with `Select`).

    With tied embeddings the one HF table feeds both the embedding and the head keys (an `lm_head.weight`
    in the checkpoint, which transformers may or may not write, is ignored). The expert bias loads from
    the extra tensors d9d's export writes (`checkpoint_has_expert_bias`, see `has_expert_bias`), starts at
    zero when the checkpoint has none, and is dropped when `config` has no bias.
    """
    embed = _vocab("model.embed_tokens.weight", "model.embed_tokens", config.splits)
    parts = _body(config, expert_layout)
    if config.tie_word_embeddings:
        names = list(config.splits)
        duplicates = [
            Duplicate(
                f"model.embed_tokens.weights.{n}", [f"model.embed_tokens.weights.{n}", f"lm_head.weights.{n}"]
            )
            for n in names
        ]
        parts.append(Sequential([embed, Parallel(duplicates)]))
        if checkpoint_has_lm_head:
            parts.append(Drop(["lm_head.weight"]))
    else:
        parts += [embed, _vocab("lm_head.weight", "lm_head", config.splits)]
    bias_keys = _expert_bias_keys(config)
    if bias_keys and checkpoint_has_expert_bias:
        parts.append(Rename(dict(zip(expert_bias_hf_keys(config), bias_keys, strict=True))))
    elif bias_keys:
        assert isinstance(config, Qwen3MoEConfig)
        experts = config.num_experts
        parts.append(
            Function(
                [], bias_keys, lambda _: {k: torch.zeros(experts) for k in bias_keys}, name="ZeroExpertBias"
            )
        )
    elif checkpoint_has_expert_bias:
        parts.append(Drop(expert_bias_hf_keys(config)))
    return Parallel(parts)


def d9d_to_hf_mapper(config: Qwen3Config, *, expert_layout: ExpertLayout = "per_expert") -> StateMapper:
    """A whole d9d causal-LM model's keys → HF checkpoint keys. A tied head is dropped (HF ties it itself);
    the expert bias, which HF Qwen3-MoE does not have, is kept as extra tensors `expert_bias_hf_keys`."""
    embed = _vocab("model.embed_tokens.weight", "model.embed_tokens", config.splits).inverse()
    parts = [m.inverse() for m in _body(config, expert_layout)] + [embed]
    if config.tie_word_embeddings:
        parts.append(Drop([f"lm_head.weights.{n}" for n in config.splits]))
    else:
        parts.append(_vocab("lm_head.weight", "lm_head", config.splits).inverse())
    bias_keys = _expert_bias_keys(config)
    if bias_keys:
        parts.append(Rename(dict(zip(bias_keys, expert_bias_hf_keys(config), strict=True))))
    return Parallel(parts)


def expected_hf_shapes(
    config: Qwen3Config, model_state: Mapping[str, torch.Tensor], expert_layout: ExpertLayout
) -> dict[str, tuple[int, ...]]:
    """The HF key → shape a checkpoint for `config` must have, derived by running the save mapper over
    the (meta-device) state of a whole model, so the expectation can never drift from the mapping."""
    mapper = d9d_to_hf_mapper(config, expert_layout=expert_layout)
    shapes: dict[str, tuple[int, ...]] = {}
    for group in mapper.groups():
        out = apply_group(mapper, group, {k: model_state[k] for k in group.inputs})
        shapes |= {k: tuple(t.shape) for k, t in out.items()}
    return shapes
