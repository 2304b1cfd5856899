"""State-mapper pieces the families' Hugging Face formats are built from.

Differences handled here: vocabulary splits (HF has one table), tied heads, expert weights (HF stores either
one module per expert — transformers v4 and what v5 writes — or fused `[E, 2I, H]` / `[E, H, I]` tensors in
memory, d9d stores `[E, in, out]` with gate and up fused as `gate_up_proj` [E, H, 2I]), and the expert bias
(`model.layers.<i>.mlp.gate.e_score_correction_bias`, DeepSeek-V3's name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from d9d.models.family import EXPERT_BIAS_HF_NAME, CheckpointTraits, ExpertLayout
from d9d.state.mapper import (
    Concat,
    Drop,
    Duplicate,
    Function,
    Parallel,
    Rename,
    Sequential,
    Split,
    Stack,
    StateMapper,
    Transpose,
)

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def vocab_mapper(hf_key: str, d9d_prefix: str, splits: Mapping[str, int]) -> StateMapper:
    """One HF vocabulary table → d9d's per-split parameters `<prefix>.weights.<split>`."""
    names = [f"{d9d_prefix}.weights.{name}" for name in splits]
    if len(names) == 1:
        return Rename({hf_key: names[0]})
    return Split(hf_key, names, dim=0, sizes=list(splits.values()))


def experts_mapper(num_experts: int, intermediate_size: int, layout: ExpertLayout) -> StateMapper:
    """Per layer, HF expert tensors (unprefixed) → `mlp.experts.gate_up_proj` [E, H, 2I] (gate in the first
    I output columns, up in the last) and `mlp.experts.down_proj` [E, I, H]."""
    gate_up, down = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
    if layout == "fused":
        # HF's fused [E, 2I, H] (gate rows first) and [E, H, I] share the key names with ours
        return Transpose([gate_up, down])

    def stack(projection: str, target: str) -> StateMapper:
        return Stack([f"mlp.experts.{e}.{projection}.weight" for e in range(num_experts)], target, dim=0)

    gate, up = "mlp.experts.gate_proj", "mlp.experts.up_proj"  # [E, I, H] on the way to `gate_up`
    return Parallel(
        [
            Sequential(
                [
                    stack("gate_proj", gate),
                    stack("up_proj", up),
                    Concat([gate, up], gate_up, dim=1, sizes=[intermediate_size, intermediate_size]),
                    Transpose([gate_up]),
                ]
            ),
            Sequential([stack("down_proj", down), Transpose([down])]),
        ]
    )


def embeddings_to_d9d(splits: Mapping[str, int], tied: bool, traits: CheckpointTraits) -> list[StateMapper]:
    """The embedding table and the LM head. With tied embeddings the one HF table feeds both the embedding
    and the head keys (an `lm_head.weight` in the checkpoint, which transformers may or may not write, is
    ignored)."""
    embed = vocab_mapper("model.embed_tokens.weight", "model.embed_tokens", splits)
    if not tied:
        return [embed, vocab_mapper("lm_head.weight", "lm_head", splits)]
    duplicates = [
        Duplicate(
            f"model.embed_tokens.weights.{n}", [f"model.embed_tokens.weights.{n}", f"lm_head.weights.{n}"]
        )
        for n in splits
    ]
    parts: list[StateMapper] = [Sequential([embed, Parallel(duplicates)])]
    if traits.has_lm_head:
        parts.append(Drop(["lm_head.weight"]))
    return parts


def embeddings_to_hf(splits: Mapping[str, int], tied: bool) -> list[StateMapper]:
    """The inverse of `embeddings_to_d9d`; a tied head is dropped (HF ties it itself)."""
    embed = vocab_mapper("model.embed_tokens.weight", "model.embed_tokens", splits).inverse()
    if tied:
        return [embed, Drop([f"lm_head.weights.{n}" for n in splits])]
    return [embed, vocab_mapper("lm_head.weight", "lm_head", splits).inverse()]


def expert_bias_hf_keys(moe_layers: Sequence[int]) -> list[str]:
    return [f"model.layers.{i}.{EXPERT_BIAS_HF_NAME}" for i in moe_layers]


def expert_bias_d9d_keys(moe_layers: Sequence[int]) -> list[str]:
    return [f"model.layers.{i}.mlp.gate.expert_bias" for i in moe_layers]


def expert_bias_to_d9d(
    moe_layers: Sequence[int], num_experts: int, wanted: bool, traits: CheckpointTraits
) -> list[StateMapper]:
    """The expert bias loads from the checkpoint's `e_score_correction_bias` tensors, starts at zero when the
    checkpoint has none, and is dropped when the model has no bias."""
    hf_keys, ours = expert_bias_hf_keys(moe_layers), expert_bias_d9d_keys(moe_layers)
    if not moe_layers:
        return []
    if wanted and traits.has_expert_bias:
        return [Rename(dict(zip(hf_keys, ours, strict=True)))]
    if wanted:
        return [
            Function([], ours, lambda _: {k: torch.zeros(num_experts) for k in ours}, name="ZeroExpertBias")
        ]
    if traits.has_expert_bias:
        return [Drop(hf_keys)]
    return []


def expert_bias_to_hf(moe_layers: Sequence[int], wanted: bool) -> list[StateMapper]:
    if not wanted or not moe_layers:
        return []
    return [Rename(dict(zip(expert_bias_d9d_keys(moe_layers), expert_bias_hf_keys(moe_layers), strict=True)))]
