"""SwiGLU's gate `silu(gate) · up` forward and backward in Triton, one elementwise pass each.

Forward reads gate and up once and writes the product (the reference writes silu(gate) and then the
product). Backward recomputes the sigmoid from the saved gate instead of keeping `silu(gate)` alive, and
writes both gradients in one pass. Float32 math, one rounding per output. Importing this module imports
Triton; `TRITON_INTERPRET=1` must be set before the import to run the kernels on CPU tensors.
"""

# Triton reads a kernel's parameter annotations as argument types, so kernels stay unannotated and keep
# Triton's upper-case constexpr naming.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# ruff: noqa: ANN001, ANN202, N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _forward_kernel(gate_ptr, up_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(grad_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    dy = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    grad_gate = dy * u * (sig + silu * (1.0 - sig))
    tl.store(grad_gate_ptr + offsets, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + offsets, (dy * silu).to(grad_up_ptr.dtype.element_ty), mask=mask)


def swiglu_forward_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    numel = gate.numel()
    if numel:
        _forward_kernel[(triton.cdiv(numel, _BLOCK),)](gate, up, out, numel, BLOCK=_BLOCK)
    return out


def swiglu_backward_triton(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = gate.contiguous(), up.contiguous()
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
    numel = gate.numel()
    if numel:
        _backward_kernel[(triton.cdiv(numel, _BLOCK),)](
            grad_out.contiguous(), gate, up, grad_gate, grad_up, numel, BLOCK=_BLOCK
        )
    return grad_gate, grad_up
