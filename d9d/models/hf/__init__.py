"""Hugging Face interop for every registered family: config conversion, state mappers, `from_pretrained` /
`save_pretrained`. The family-specific parts live in each family's folder (`ModelFamily.hf`); the pieces
they are built from in `d9d.models.hf.mappers` and `d9d.models.hf.rope`."""

from d9d.models.hf.config import (
    EXPERT_BIAS_CONFIG_KEY,
    EXPERT_BIAS_HF_NAME,
    config_from_hf,
    config_to_hf,
    hf_export_gap,
)
from d9d.models.hf.io import (
    SIDE_FILES,
    build_causal_lm,
    check_checkpoint_matches,
    from_pretrained,
    save_pretrained,
    side_files,
)
from d9d.models.hf.mapping import (
    ExpertLayout,
    d9d_to_hf_mapper,
    detect_expert_layout,
    expected_hf_shapes,
    expert_bias_hf_keys,
    has_expert_bias,
    hf_to_d9d_mapper,
    hf_to_d9d_mapper_for,
)

__all__ = [
    "EXPERT_BIAS_CONFIG_KEY",
    "EXPERT_BIAS_HF_NAME",
    "SIDE_FILES",
    "ExpertLayout",
    "build_causal_lm",
    "check_checkpoint_matches",
    "config_from_hf",
    "config_to_hf",
    "d9d_to_hf_mapper",
    "detect_expert_layout",
    "expected_hf_shapes",
    "expert_bias_hf_keys",
    "from_pretrained",
    "has_expert_bias",
    "hf_export_gap",
    "hf_to_d9d_mapper",
    "hf_to_d9d_mapper_for",
    "save_pretrained",
    "side_files",
]
