"""The row-wise cross-entropy kernels against their PyTorch reference (and that against float64)."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from d9d.kernels.cross_entropy import ce_grad, ce_rows
from d9d.kernels.cross_entropy.reference import ce_grad_torch, ce_rows_torch
from tests.triton_interpreter import run_in_interpreter


def test_reference_matches_autograd_of_cross_entropy_in_float64() -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, 50, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (9,))
    labels[[1, 4]] = -100
    scale = torch.rand(9, dtype=torch.float64)
    lse, loss = ce_rows_torch(logits.detach(), labels, -100)
    expected = F.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(lse, torch.logsumexp(logits.detach(), -1))
    (expected * scale).sum().backward()
    torch.testing.assert_close(ce_grad_torch(logits.detach(), lse, labels, scale, -100), logits.grad)


def test_cpu_tensors_take_the_reference_unless_triton_is_asked_for() -> None:
    logits, labels = torch.randn(3, 7), torch.tensor([0, 6, -100])
    lse, loss = ce_rows(logits, labels, -100)
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels, reduction="none"))
    grad = ce_grad(logits, lse, labels, torch.ones(3), -100)
    assert grad.dtype == logits.dtype and grad[2].abs().sum() == 0


# Runs in a fresh interpreter: Triton reads TRITON_INTERPRET when `@triton.jit` decorates.
_INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    import d9d.kernels.cross_entropy.triton_kernels as tk
    from d9d.kernels.cross_entropy.reference import ce_grad_torch, ce_rows_torch

    tk._BLOCK = 64  # several blocks per row and a ragged last one
    generator = torch.Generator().manual_seed(0)
    for dtype, rows, vocab in [(torch.float32, 5, 300), (torch.bfloat16, 4, 129), (torch.float32, 3, 64)]:
        logits = (torch.randn(rows, vocab, generator=generator) * 4).to(dtype)
        labels = torch.randint(0, vocab, (rows,), generator=generator)
        labels[1] = -100
        labels[0] = vocab - 1
        scale = torch.rand(rows, generator=generator)
        lse, loss = tk.ce_rows_triton(logits, labels, -100)
        ref_lse, ref_loss = ce_rows_torch(logits, labels, -100)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert loss[1] == 0
        ref_grad = ce_grad_torch(logits, ref_lse, labels, scale, -100)
        grad = tk.ce_grad_triton(logits, lse, labels, scale, -100)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol)
        assert grad[1].abs().sum() == 0
        in_place = logits.clone()
        out = tk.ce_grad_triton(in_place, lse, labels, scale, -100, in_place=True)
        assert out.data_ptr() == in_place.data_ptr() and torch.equal(out, grad)
        # strided rows (a slice of a wider buffer), as the head's chunks of a concatenation may be
        wide = torch.zeros(rows, vocab + 7, dtype=dtype)
        wide[:, :vocab] = logits
        lse_w, loss_w = tk.ce_rows_triton(wide[:, :vocab], labels, -100)
        assert torch.equal(lse_w, lse) and torch.equal(loss_w, loss)
    print("interpreter ok")
    """
)


def test_triton_kernels_match_reference_in_the_interpreter() -> None:
    run_in_interpreter(_INTERPRETER_CHECK)


@pytest.mark.gpu
def test_linear_cross_entropy_triton_matches_reference_on_cuda() -> None:
    from d9d.modules.heads import linear_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(3000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights = [(torch.randn(n, 256, device="cuda") * 0.05).bfloat16().requires_grad_() for n in (5000, 37)]
    labels = torch.randint(0, 5037, (3000,), device="cuda")
    labels[::7] = -100
    grads: dict[tuple[str, bool], list[torch.Tensor]] = {}
    for backend in ("torch", "triton"):
        for eager in (False, True):
            for t in (hidden, *weights):
                t.grad = None
            losses = linear_cross_entropy(
                hidden, weights, labels, chunk_size=512, eager_grads=eager, backend=backend
            )
            (losses.sum() / 1000).backward()
            grads[backend, eager] = [losses.detach()]
            for t in (hidden, *weights):
                assert t.grad is not None
                grads[backend, eager].append(t.grad)
    reference = grads["torch", False]
    for key, got in grads.items():
        for a, b in zip(got, reference, strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3, msg=str(key))
