"""The SwiGLU gate kernels against their PyTorch reference."""

from __future__ import annotations

import textwrap

import pytest
import torch

from d9d.kernels.swiglu import swiglu
from d9d.kernels.swiglu.ops import swiglu_backward_op, swiglu_op
from d9d.kernels.swiglu.reference import swiglu_backward_torch, swiglu_torch
from tests.triton_interpreter import run_in_interpreter
from tests.triton_targets import compile_for_h100, needs_no_gpu


def test_hand_written_backward_matches_autograd_in_float64() -> None:
    torch.manual_seed(0)
    gate = (torch.randn(4, 37, dtype=torch.float64) * 4).requires_grad_()
    up = torch.randn(4, 37, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(4, 37, dtype=torch.float64)
    (swiglu_torch(gate, up) * grad_out).sum().backward()
    grad_gate, grad_up = swiglu_backward_torch(grad_out, gate.detach(), up.detach())
    torch.testing.assert_close(grad_gate, gate.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_up, up.grad, rtol=1e-6, atol=1e-6)


def test_custom_op_on_cpu_matches_the_reference_and_passes_opcheck() -> None:
    torch.manual_seed(0)
    gate, up, cot = torch.randn(3, 5, 24), torch.randn(3, 5, 24), torch.randn(3, 5, 24)
    results = []
    for fn in (lambda g, u: swiglu(g, u, backend="triton"), swiglu_torch):
        leaves = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
        out = fn(*leaves)
        out.backward(cot)
        results.append([out.detach(), *(leaf.grad for leaf in leaves)])
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    torch.library.opcheck(swiglu_op, (gate.requires_grad_(), up.requires_grad_()))
    torch.library.opcheck(swiglu_backward_op, (cot, gate.detach(), up.detach()))
    strided = torch.randn(24, 5).t()  # non-contiguous: outputs are contiguous in fake and real runs alike
    torch.library.opcheck(swiglu_op, (strided, strided.clone()))
    torch.library.opcheck(swiglu_backward_op, (strided, strided, strided))


_INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    import d9d.kernels.swiglu.triton_kernels as tk
    from d9d.kernels.swiglu import swiglu
    from d9d.kernels.swiglu.reference import swiglu_torch

    tk._BLOCK = 128  # several blocks and a ragged last one
    generator = torch.Generator().manual_seed(0)
    # the interpreter rounds to bfloat16 by truncation (the GPU rounds to nearest): one ulp of slack
    for dtype, shape in [(torch.float32, (3, 7, 96)), (torch.bfloat16, (5, 100)), (torch.float32, (1, 1, 1))]:
        gate = (torch.randn(*shape, generator=generator) * 3).to(dtype)
        up = torch.randn(*shape, generator=generator).to(dtype)
        cot = torch.randn(*shape, generator=generator).to(dtype)
        results = []
        for fn in (lambda g, u: swiglu(g, u, backend="triton"), swiglu_torch):
            leaves = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
            out = fn(*leaves)
            out.backward(cot)
            assert out.dtype == dtype and all(leaf.grad.dtype == dtype for leaf in leaves)
            results.append([t.float() for t in (out.detach(), *(leaf.grad for leaf in leaves))])
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, **tol)
    print("interpreter ok")
    """
)


def test_triton_kernels_match_reference_in_the_interpreter() -> None:
    run_in_interpreter(_INTERPRETER_CHECK)


@needs_no_gpu
def test_kernels_compile_for_an_h100() -> None:
    import d9d.kernels.swiglu.triton_kernels as tk

    compile_for_h100(
        tk._forward_kernel,
        {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16", "numel": "i64", "BLOCK": "constexpr"},
        {"BLOCK": 2048},
    )
    compile_for_h100(
        tk._backward_kernel,
        dict.fromkeys(("grad_ptr", "gate_ptr", "up_ptr", "grad_gate_ptr", "grad_up_ptr"), "*bf16")
        | {"numel": "i32", "BLOCK": "constexpr"},
        {"BLOCK": 2048},
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_reference_on_cuda(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    gate = torch.randn(4, 2048, 3000, device="cuda", dtype=dtype) * 3
    up = torch.randn(4, 2048, 3000, device="cuda", dtype=dtype)
    cot = torch.randn_like(up)
    results = []
    for fn, cast in ((lambda g, u: swiglu(g, u, backend="triton"), dtype), (swiglu_torch, torch.float64)):
        leaves = [t.detach().to(cast).clone().requires_grad_() for t in (gate, up)]
        out = fn(*leaves)
        out.backward(cot.to(cast))
        results.append([t.double() for t in (out.detach(), *(leaf.grad for leaf in leaves))])
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, **tol)
