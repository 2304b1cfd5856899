"""Rotary embedding of q and k ("half" layout) in plain PyTorch: the kernels' reference.

With `x = [x1, x2]` (the two halves of the head dim) and tables `cos = [c1, c2]`, `sin = [s1, s2]`
([batch or 1, seq, head_dim]), the rotation is `[x1·c1 − x2·s1, x2·c2 + x1·s2]`. Its transpose (the
backward; the rotation by −angle when both halves of the tables agree, as RotaryEmbedding builds them) is
`[x1·c1 + x2·s2, x2·c2 − x1·s1]`. `rope_qk_forward_torch` computes either in (at least) float32 without
`cat`: the custom op's CPU implementation and a check of the kernel's formula.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates `x` [batch, seq, heads, head_dim] by tables [batch, seq, head_dim]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    out_dtype = torch.promote_types(x.dtype, cos.dtype)
    compute = torch.promote_types(out_dtype, torch.float32)
    x1, x2 = x.to(compute).chunk(2, dim=-1)
    c1, c2 = cos.to(compute).unsqueeze(2).chunk(2, dim=-1)
    s1, s2 = sin.to(compute).unsqueeze(2).chunk(2, dim=-1)
    if inverse:
        s1, s2 = -s2, -s1
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out[..., : x.shape[-1] // 2] = x1 * c1 - x2 * s1
    out[..., x.shape[-1] // 2 :] = x2 * c2 + x1 * s2
    return out


def rope_qk_forward_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, cos, sin, inverse), _rotate(k, cos, sin, inverse)
