"""The rotary (RoPE) q/k kernels against their PyTorch reference."""

from __future__ import annotations

import textwrap

import pytest
import torch

from d9d.kernels.rotary import rope_qk
from d9d.kernels.rotary.ops import rope_qk_op
from d9d.kernels.rotary.reference import rope_qk_forward_torch, rope_torch
from d9d.modules.rotary import RotaryEmbedding
from tests.triton_interpreter import run_in_interpreter
from tests.triton_targets import compile_for_h100, needs_no_gpu


def _tables(
    batch: int, seq: int, head_dim: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    positions = torch.randint(0, 500, (batch, seq))
    rotary = RotaryEmbedding(head_dim, 10000.0)(positions, dtype)
    return rotary.cos, rotary.sin


def test_inverse_is_the_transpose_and_undoes_the_rotation_in_float64() -> None:
    torch.manual_seed(0)
    cos, sin = _tables(2, 5, 12, torch.float64)
    q = torch.randn(2, 5, 3, 12, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 1, 12, dtype=torch.float64, requires_grad=True)
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    ((rope_torch(q, cos, sin) * grad_q).sum() + (rope_torch(k, cos, sin) * grad_k).sum()).backward()
    back_q, back_k = rope_qk_forward_torch(grad_q, grad_k, cos, sin, True)
    torch.testing.assert_close(back_q, q.grad)
    torch.testing.assert_close(back_k, k.grad)
    rotated = rope_qk_forward_torch(q.detach(), k.detach(), cos, sin, False)
    undone = rope_qk_forward_torch(*rotated, cos, sin, True)
    torch.testing.assert_close(undone, (q.detach(), k.detach()))


def test_custom_op_on_cpu_matches_the_reference_and_passes_opcheck() -> None:
    torch.manual_seed(0)
    cos, sin = _tables(2, 6, 16)
    q, k = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16)
    cot = (torch.randn_like(q), torch.randn_like(k))
    results = []
    for fn in (
        lambda a, b: rope_qk(a, b, cos, sin, backend="triton"),
        lambda a, b: (rope_torch(a, cos, sin), rope_torch(b, cos, sin)),
    ):
        leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
        outs = fn(*leaves)
        torch.autograd.backward(outs, cot)
        results.append([*(o.detach() for o in outs), *(leaf.grad for leaf in leaves)])
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    torch.library.opcheck(rope_qk_op, (q.requires_grad_(), k.requires_grad_(), cos, sin, False))
    strided_q = torch.randn(2, 4, 6, 16).transpose(1, 2)  # non-contiguous [2, 6, 4, 16]
    torch.library.opcheck(rope_qk_op, (strided_q, k.detach(), cos, sin, True))


_INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    import d9d.kernels.rotary.triton_kernels as tk
    from d9d.kernels.rotary import rope_qk
    from d9d.kernels.rotary.reference import rope_torch
    from d9d.modules.rotary import RotaryEmbedding

    tk._TILE = 256  # several tiles and a ragged last one
    generator = torch.Generator().manual_seed(0)
    # (dtype, batch, seq, q heads, k heads, head_dim, tables shared over the batch)
    cases = [
        (torch.float32, 2, 7, 4, 2, 16, False),
        (torch.bfloat16, 3, 5, 3, 1, 24, True),
        (torch.float32, 1, 9, 6, 6, 128, False),
    ]
    for dtype, batch, seq, hq, hk, head_dim, shared in cases:
        positions = torch.randint(0, 1000, (1 if shared else batch, seq), generator=generator)
        tables = RotaryEmbedding(head_dim, 10000.0)(positions, dtype)
        q = torch.randn(batch, seq, hq, head_dim, generator=generator).to(dtype)
        k = torch.randn(batch, seq, hk, head_dim, generator=generator).to(dtype)
        cot = tuple(torch.randn(t.shape, generator=generator).to(dtype) for t in (q, k))
        results = []
        for fn in (
            lambda a, b: rope_qk(a, b, tables.cos, tables.sin, backend="triton"),
            lambda a, b: (rope_torch(a, tables.cos, tables.sin), rope_torch(b, tables.cos, tables.sin)),
        ):
            leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
            outs = fn(*leaves)
            torch.autograd.backward(outs, cot)
            assert all(t.dtype == dtype for t in (*outs, *(leaf.grad for leaf in leaves)))
            results.append([t.float() for t in (*outs, *(leaf.grad for leaf in leaves))])
        # the interpreter rounds to bfloat16 by truncation (the GPU rounds to nearest): one ulp of slack
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, **tol)
    print("interpreter ok")
    """
)


def test_triton_kernel_matches_reference_in_the_interpreter() -> None:
    run_in_interpreter(_INTERPRETER_CHECK)


@needs_no_gpu
@pytest.mark.parametrize("inverse", [False, True])
def test_kernel_compiles_for_an_h100(inverse: bool) -> None:
    import d9d.kernels.rotary.triton_kernels as tk

    compile_for_h100(
        tk._rope_kernel,
        dict.fromkeys(("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "q_out_ptr", "k_out_ptr"), "*bf16")
        | dict.fromkeys(
            ("q_rows", "k_rows", "q_tiles", "seq", "table_batch_stride", "table_seq_stride"), "i32"
        )
        | dict.fromkeys(("HEADS_Q", "HEADS_K", "HALF", "BLOCK_R", "BLOCK_D", "INVERSE"), "constexpr"),
        {"HEADS_Q": 16, "HEADS_K": 8, "HALF": 64, "BLOCK_R": 64, "BLOCK_D": 64, "INVERSE": inverse},
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference_on_cuda(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    positions = torch.arange(2048, device="cuda").expand(4, 2048)
    tables = RotaryEmbedding(128, 1e6)(positions, dtype)
    q = torch.randn(4, 2048, 16, 128, device="cuda", dtype=dtype)
    k = torch.randn(4, 2048, 8, 128, device="cuda", dtype=dtype)
    cot = (torch.randn_like(q), torch.randn_like(k))
    results = []
    for fn, cast in (
        (lambda a, b: rope_qk(a, b, tables.cos, tables.sin, backend="triton"), dtype),
        (
            lambda a, b: rope_qk_forward_torch(a, b, tables.cos.double(), tables.sin.double(), False),
            torch.float64,
        ),
    ):
        leaves = [t.detach().to(cast).clone().requires_grad_() for t in (q, k)]
        outs = fn(*leaves)
        torch.autograd.backward(outs, tuple(c.to(cast) for c in cot))
        results.append([t.double() for t in (*outs, *(leaf.grad for leaf in leaves))])
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, **tol)
