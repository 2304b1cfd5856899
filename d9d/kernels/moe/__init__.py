"""MoE token movement: the expert permutation (stable sort, no host sync) and permute / weighted combine
as custom ops with Triton kernels on CUDA and PyTorch references elsewhere."""

from d9d.kernels.moe.ops import combine_tokens, permute_tokens
from d9d.kernels.moe.permutation import ExpertPermutation, block_regroup, count_per_expert, expert_permutation

__all__ = [
    "ExpertPermutation",
    "block_regroup",
    "combine_tokens",
    "count_per_expert",
    "expert_permutation",
    "permute_tokens",
]
