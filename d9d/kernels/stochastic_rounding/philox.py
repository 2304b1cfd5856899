"""Philox4x32-10 in plain PyTorch integer ops: the random source of stochastic rounding.

A counter-based generator makes the random bits a pure function of (key, counter). The Triton kernel runs
the same function per element group, so the reference path and the kernel draw identical bits, and no
generator state has to be stored besides the key and the counter inputs.

uint32 values live in int64 tensors. A 32x32-bit product can exceed 2**63; torch's int64 multiply wraps
modulo 2**64 (two's complement) on CPU and CUDA, and the high/low words are read back with masks, which is
correct under wrapping. The Random123 known-answer tests (one of which overflows) check this per platform.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
MULTIPLIER_A = 0xD2511F53
MULTIPLIER_B = 0xCD9E8D57
KEY_BUMP_A = 0x9E3779B9
KEY_BUMP_B = 0xBB67AE85
ROUNDS = 10


def _mulhilo(x: Tensor, multiplier: int) -> tuple[Tensor, Tensor]:
    """High and low 32 bits of `x * multiplier` for uint32 `x` and a 32-bit constant."""
    product = x * multiplier
    return (product >> 32) & MASK32, product & MASK32


def philox4x32(
    counter: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple[int, int]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32 with 10 rounds on int64 tensors holding uint32 values (broadcast together)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(ROUNDS):
        high_b, low_b = _mulhilo(c2, MULTIPLIER_B)
        high_a, low_a = _mulhilo(c0, MULTIPLIER_A)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0 = (k0 + KEY_BUMP_A) & MASK32
        k1 = (k1 + KEY_BUMP_B) & MASK32
    return c0, c1, c2, c3


def split_key(seed: int) -> tuple[int, int]:
    """The two 32-bit Philox key words of a 64-bit seed."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed={seed} must be in [0, 2**64)")
    return seed & MASK32, seed >> 32


def philox_bits16(
    numel: int, first_index: int, counter_tail: tuple[int, int, int], seed: int, device: torch.device
) -> Tensor:
    """16 random bits (int32 in [0, 65536)) for elements `first_index .. first_index + numel - 1`.

    Element `i` takes the 16-bit half `i % 2` (low half first) of output word `(i % 8) // 2` of the Philox
    block whose counter is `(i // 8, *counter_tail)`: one block feeds eight elements.
    """
    head = first_index % 8
    first_group = first_index // 8
    groups = (head + numel + 7) // 8
    if first_group + groups > 2**32:
        raise ValueError(
            f"element index {first_index + numel} exceeds the 2**35 elements a stream can number"
        )
    c0 = torch.arange(first_group, first_group + groups, dtype=torch.int64, device=device)
    tail = [torch.full_like(c0, value) for value in counter_tail]
    words = philox4x32((c0, tail[0], tail[1], tail[2]), split_key(seed))
    halves = torch.empty(groups, 8, dtype=torch.int32, device=device)
    for w, word in enumerate(words):
        halves[:, 2 * w] = word & 0xFFFF
        halves[:, 2 * w + 1] = word >> 16
    return halves.view(-1)[head : head + numel]
