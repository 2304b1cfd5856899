"""The RMSNorm kernels (plain and with the fused residual add) against their PyTorch reference."""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch

from d9d.kernels import backend as kernel_backend
from d9d.kernels.rms_norm import add_rms_norm, rms_norm
from d9d.kernels.rms_norm.ops import add_rms_norm_op, rms_norm_backward_op, rms_norm_op
from d9d.kernels.rms_norm.reference import add_rms_norm_torch, rms_norm_backward_torch, rms_norm_torch
from tests.triton_interpreter import run_in_interpreter
from tests.triton_targets import compile_for_h100, needs_no_gpu


@pytest.mark.parametrize("zero_centered", [False, True])
def test_hand_written_backward_matches_autograd_in_float64(zero_centered: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(3, 5, 24, dtype=torch.float64)
    (rms_norm_torch(x, weight, 1e-5, zero_centered) * grad_out).sum().backward()
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1) + 1e-5)
    grad_x, grad_w = rms_norm_backward_torch(grad_out, x.detach(), weight.detach(), rstd, zero_centered)
    # the reference (like Hugging Face's) computes its statistics in float32 even for float64 inputs
    torch.testing.assert_close(grad_x, x.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_w, weight.grad, rtol=1e-6, atol=1e-6)


def _grads(
    fn: object, inputs: list[torch.Tensor], cotangents: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)  # type: ignore[operator]
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    torch.autograd.backward(outs, cotangents[: len(outs)])
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]  # type: ignore[misc]


@pytest.mark.parametrize("zero_centered", [False, True])
def test_custom_ops_on_cpu_match_the_reference(zero_centered: bool) -> None:
    """backend="triton" on a plain CPU runs the ops' PyTorch twin: what a compiled CPU graph executes."""
    torch.manual_seed(0)
    x, res = torch.randn(2, 7, 3, 20), torch.randn(2, 7, 3, 20)
    weight = torch.randn(20) * 0.1 + (0.0 if zero_centered else 1.0)
    cot = [torch.randn(2, 7, 3, 20), torch.randn(2, 7, 3, 20)]
    got = _grads(
        lambda a, w: rms_norm(a, w, 1e-6, zero_centered=zero_centered, backend="triton"), [x, weight], cot
    )
    ref = _grads(lambda a, w: rms_norm_torch(a, w, 1e-6, zero_centered), [x, weight], cot)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    got = _grads(
        lambda a, r, w: add_rms_norm(a, r, w, 1e-6, zero_centered=zero_centered, backend="triton"),
        [x, res, weight],
        cot,
    )
    ref = _grads(lambda a, r, w: add_rms_norm_torch(a, r, w, 1e-6, zero_centered), [x, res, weight], cot)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_opcheck_registrations() -> None:
    torch.manual_seed(0)
    x, res, weight = torch.randn(4, 6), torch.randn(4, 6), torch.randn(6)
    strided = torch.randn(6, 4).t()  # non-contiguous: outputs are contiguous in fake and real runs alike
    torch.library.opcheck(rms_norm_op, (x.requires_grad_(), weight.requires_grad_(), 1e-6, False))
    torch.library.opcheck(rms_norm_op, (strided, weight, 1e-6, False))
    torch.library.opcheck(add_rms_norm_op, (x, res.requires_grad_(), weight, 1e-6, True))
    torch.library.opcheck(add_rms_norm_op, (strided, res, weight, 1e-6, True))
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1) + 1e-6)
    args = (torch.randn(4, 6), x.detach(), weight.detach(), rstd, res.detach(), False)
    torch.library.opcheck(rms_norm_backward_op, args)
    torch.library.opcheck(rms_norm_backward_op, (strided, strided, weight.detach(), rstd, None, False))


def test_unsupported_input_falls_back_with_one_warning_naming_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernel_backend, "_WARNED", set())
    x, weight = torch.randn(3, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="rms_norm.*dtype torch.float64"):
        out = rms_norm(x, weight, 1e-6, backend="triton")
    assert torch.equal(out, rms_norm_torch(x, weight, 1e-6, False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rms_norm(x, weight, 1e-6, backend="triton")  # the same reason again: no second warning


def test_unsupported_input_inside_compile_still_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_backend, "_WARNED", set())
    x, weight = torch.randn(3, 8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    compiled = torch.compile(lambda a, w: rms_norm(a, w, 1e-6, backend="triton"), backend="eager")
    with pytest.warns(RuntimeWarning, match="rms_norm.*dtype torch.float64"):
        out = compiled(x, weight)
    assert torch.equal(out, rms_norm_torch(x, weight, 1e-6, False))


def test_auto_on_cpu_and_inside_compile_takes_the_reference() -> None:
    device = torch.device("cpu")
    assert kernel_backend.choose_kernel("t", "auto", device, lambda: None) == "torch"
    assert kernel_backend.choose_kernel("t", "triton", device, lambda: None) == "triton"

    def traced(x: torch.Tensor) -> torch.Tensor:
        chosen = kernel_backend.choose_kernel("t", "auto", torch.device("cuda"), lambda: None)
        return x + (1 if chosen == "torch" else 2)

    assert torch.compile(traced, backend="eager", fullgraph=True)(torch.zeros(1)).item() == 1


# Runs in a fresh interpreter: Triton reads TRITON_INTERPRET when `@triton.jit` decorates. The cases cover
# a non-power-of-two row, odd row counts, the per-head layout [batch, seq, heads, head_dim], several
# backward programs with a ragged last tile, and both dtypes. The interpreter rounds float32 to bfloat16
# by truncation (the GPU rounds to nearest), so bfloat16 results may differ by one unit in the last place.
_INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    import d9d.kernels.rms_norm.triton_kernels as tk
    from d9d.kernels.rms_norm import add_rms_norm, rms_norm
    from d9d.kernels.rms_norm.reference import add_rms_norm_torch, rms_norm_torch

    tk._TILE = 256  # several tiles (and backward iterations) even on these small shapes
    generator = torch.Generator().manual_seed(0)
    cases = [
        (torch.float32, (5, 33), False),
        (torch.float32, (2, 3, 7, 16), True),
        (torch.bfloat16, (3, 5, 2, 128), False),
        (torch.float32, (301, 100), False),
        (torch.bfloat16, (7, 96), True),
    ]
    for dtype, shape, zero_centered in cases:
        n = shape[-1]
        x = torch.randn(*shape, generator=generator).to(dtype)
        res = torch.randn(*shape, generator=generator).to(dtype)
        weight = (torch.randn(n, generator=generator) * 0.2 + (0.0 if zero_centered else 1.0)).to(dtype)
        cot = [torch.randn(*shape, generator=generator).to(dtype) for _ in range(2)]
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=4e-2)
        for fused in (False, True):
            results = []
            for fn in (
                (lambda a, r, w: add_rms_norm(a, r, w, 1e-6, zero_centered=zero_centered, backend="triton"))
                if fused
                else (lambda a, r, w: rms_norm(a, w, 1e-6, zero_centered=zero_centered, backend="triton")),
                (lambda a, r, w: add_rms_norm_torch(a, r, w, 1e-6, zero_centered))
                if fused
                else (lambda a, r, w: rms_norm_torch(a, w, 1e-6, zero_centered)),
            ):
                leaves = [t.clone().requires_grad_() for t in (x, res, weight)]
                outs = fn(*leaves)
                outs = list(outs) if isinstance(outs, tuple) else [outs]
                torch.autograd.backward(outs, cot[: len(outs)])
                grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
                assert all(g.dtype == t.dtype for g, t in zip(grads, (x, res, weight)))
                assert outs[0].dtype == dtype
                results.append(([o.detach().float() for o in outs], [g.float() for g in grads]))
            (outs, grads), (ref_outs, ref_grads) = results
            for got, want in zip(outs + grads, ref_outs + ref_grads):
                # the weight gradient sums over all rows: compare relative to its size
                scale = want.abs().max().clamp(min=1.0)
                torch.testing.assert_close(got / scale, want / scale, **tol)
    print("interpreter ok")
    """
)


def test_triton_kernels_match_reference_in_the_interpreter() -> None:
    run_in_interpreter(_INTERPRETER_CHECK)


@needs_no_gpu
@pytest.mark.parametrize("fused", [False, True])
def test_kernels_compile_for_an_h100(fused: bool) -> None:
    import d9d.kernels.rms_norm.triton_kernels as tk

    bf16, f32 = "*bf16", "*fp32"
    compile_for_h100(
        tk._forward_kernel,
        {"x_ptr": bf16, "res_ptr": bf16, "w_ptr": f32, "out_ptr": f32, "sum_ptr": bf16, "rstd_ptr": f32}
        | {"rows": "i32", "eps": "fp32"}
        | dict.fromkeys(("N", "BLOCK_N", "BLOCK_M", "HAS_RESIDUAL", "ZERO_CENTERED"), "constexpr"),
        {"N": 1000, "BLOCK_N": 1024, "BLOCK_M": 4, "HAS_RESIDUAL": fused, "ZERO_CENTERED": fused},
    )
    compile_for_h100(
        tk._backward_kernel,
        {"grad_out_ptr": bf16, "x_ptr": bf16, "w_ptr": bf16, "rstd_ptr": f32, "grad_sum_ptr": bf16}
        | {"grad_x_ptr": bf16, "grad_w_partial_ptr": f32, "rows": "i32"}
        | dict.fromkeys(("N", "BLOCK_N", "BLOCK_M", "ITERS", "HAS_GRAD_SUM", "ZERO_CENTERED"), "constexpr"),
        {"N": 128, "BLOCK_N": 128, "BLOCK_M": 32, "ITERS": 8, "HAS_GRAD_SUM": fused, "ZERO_CENTERED": fused},
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(4, 2048, 1024), (2, 512, 16, 128), (3, 77, 1000)])
def test_triton_matches_reference_on_cuda(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    res = torch.randn(*shape, device="cuda", dtype=dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(dtype)
    cot = [torch.randn(*shape, device="cuda", dtype=dtype) for _ in range(2)]
    for kernel, reference, inputs in (
        (
            lambda a, w: rms_norm(a, w, 1e-6, backend="triton"),
            lambda a, w: rms_norm_torch(a, w, 1e-6, False),
            [x, weight],
        ),
        (
            lambda a, r, w: add_rms_norm(a, r, w, 1e-6, backend="triton"),
            lambda a, r, w: add_rms_norm_torch(a, r, w, 1e-6, False),
            [x, res, weight],
        ),
    ):
        got_out, got_grads = _grads(kernel, inputs, cot)
        ref_out, ref_grads = _grads(reference, [t.double() for t in inputs], [c.double() for c in cot])
        tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        for got, want in zip(got_out + got_grads, ref_out + ref_grads, strict=True):
            scale = want.abs().max().clamp(min=1.0)
            torch.testing.assert_close(got.double() / scale, want / scale, **tol)
