"""Rotary embedding of q and k as a `torch.library` custom op, so a compiled region calls the kernel
without a graph break.

`d9d::rope_qk(q, k, cos, sin, inverse)`: its gradient is the same op with `inverse` flipped (a rotation's
transpose), so backward saves only the tables. The op runs the Triton kernel on GPUs and under the Triton
interpreter; on a CPU without the interpreter it runs the same math in PyTorch. Triton is imported on first
use. The tables get no gradient: they derive from position ids (the dispatcher sends tables that require
grad to the reference).
"""

# The custom-op schema is read from these annotations at decoration time: no postponed annotations here.

import torch

from d9d.kernels.backend import triton_launches_on
from d9d.kernels.rotary.reference import rope_qk_forward_torch


@torch.library.custom_op("d9d::rope_qk", mutates_args=())
def rope_qk_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_launches_on(q.device):
        from d9d.kernels.rotary.triton_kernels import rope_qk_triton

        return rope_qk_triton(q, k, cos, sin, inverse)
    return rope_qk_forward_torch(q, k, cos, sin, inverse)


@rope_qk_op.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        q.new_empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype)),
        k.new_empty(k.shape, dtype=torch.promote_types(k.dtype, cos.dtype)),
    )


def _setup(
    ctx: torch.autograd.function.FunctionCtx,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool],
    output: tuple[torch.Tensor, torch.Tensor],
) -> None:
    q, k, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse  # type: ignore[attr-defined]
    ctx.dtypes = (q.dtype, k.dtype)  # type: ignore[attr-defined]


def _backward(
    ctx: torch.autograd.function.FunctionCtx, grad_q: torch.Tensor, grad_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
    cos, sin = ctx.saved_tensors  # type: ignore[attr-defined]
    dq, dk = rope_qk_op(grad_q, grad_k, cos, sin, not ctx.inverse)  # type: ignore[attr-defined]
    q_dtype, k_dtype = ctx.dtypes  # type: ignore[attr-defined]
    return dq.to(q_dtype), dk.to(k_dtype), None, None, None


rope_qk_op.register_autograd(_backward, setup_context=_setup)
