"""The RMSNorm kernels as `torch.library` custom ops, so a compiled region calls them without a graph break.

`d9d::rms_norm` and `d9d::add_rms_norm` return the per-row `rstd` beside their outputs for backward;
`d9d::rms_norm_backward` is itself an op, so the compiled backward graph holds it too. The ops run the
Triton kernels on GPUs and under the Triton interpreter; on a CPU without the interpreter (a compiled CPU
test forcing `backend="triton"`) they run the same math in PyTorch. Triton is imported on first use.
"""

# The custom-op schema is read from these annotations at decoration time: no postponed annotations here.
# Every output is contiguous (the fake implementations say so), whatever the inputs' strides.

import torch

from d9d.kernels.backend import triton_launches_on as kernel_runs
from d9d.kernels.rms_norm.reference import rms_norm_backward_torch, rms_norm_forward_torch


@torch.library.custom_op("d9d::rms_norm", mutates_args=())
def rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if kernel_runs(x.device):
        from d9d.kernels.rms_norm.triton_kernels import rms_norm_forward_triton

        out, _, rstd = rms_norm_forward_triton(x, None, weight, eps, zero_centered)
        return out, rstd
    out, rstd = rms_norm_forward_torch(x.contiguous(), weight, eps, zero_centered)
    return out, rstd


@rms_norm_op.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return out, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("d9d::add_rms_norm", mutates_args=())
def add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if kernel_runs(x.device):
        from d9d.kernels.rms_norm.triton_kernels import rms_norm_forward_triton

        out, total, rstd = rms_norm_forward_triton(x, residual, weight, eps, zero_centered)
        assert total is not None
        return out, total, rstd
    total = (x + residual).contiguous()
    out, rstd = rms_norm_forward_torch(total, weight, eps, zero_centered)
    return out, total, rstd


@add_rms_norm_op.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return out, x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("d9d::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    grad_sum: torch.Tensor | None,
    zero_centered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of the normalized input + `grad_sum`, grad of the weight)."""
    if kernel_runs(x.device):
        from d9d.kernels.rms_norm.triton_kernels import rms_norm_backward_triton

        return rms_norm_backward_triton(grad_out, x, weight, rstd, grad_sum, zero_centered)
    grad_x, grad_w = rms_norm_backward_torch(grad_out, x, weight, rstd, zero_centered)
    if grad_sum is not None:
        grad_x = grad_x + grad_sum
    return grad_x.contiguous(), grad_w


@rms_norm_backward_op.register_fake
def _(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    grad_sum: torch.Tensor | None,
    zero_centered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_rms_norm(
    ctx: torch.autograd.function.FunctionCtx,
    inputs: tuple[torch.Tensor, torch.Tensor, float, bool],
    output: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, weight, _, zero_centered = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.zero_centered = zero_centered  # type: ignore[attr-defined]


def _backward_rms_norm(
    ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor, _grad_rstd: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, None, None]:
    x, weight, rstd = ctx.saved_tensors  # type: ignore[attr-defined]
    grad_x, grad_w = rms_norm_backward_op(grad_out, x, weight, rstd, None, ctx.zero_centered)  # type: ignore[attr-defined]
    return grad_x, grad_w, None, None


rms_norm_op.register_autograd(_backward_rms_norm, setup_context=_setup_rms_norm)


def _setup_add_rms_norm(
    ctx: torch.autograd.function.FunctionCtx,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, bool],
    output: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    _, _, weight, _, zero_centered = inputs
    # backward needs the sum that was normalized, which is an output already: nothing extra is kept
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.zero_centered = zero_centered  # type: ignore[attr-defined]


def _backward_add_rms_norm(
    ctx: torch.autograd.function.FunctionCtx,
    grad_out: torch.Tensor,
    grad_total: torch.Tensor | None,
    _grad_rstd: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
    total, weight, rstd = ctx.saved_tensors  # type: ignore[attr-defined]
    grad_x, grad_w = rms_norm_backward_op(grad_out, total, weight, rstd, grad_total, ctx.zero_centered)  # type: ignore[attr-defined]
    # d(x + residual)/dx = d(x + residual)/d residual = 1: both get the same gradient
    return grad_x, grad_x, grad_w, None, None


add_rms_norm_op.register_autograd(_backward_add_rms_norm, setup_context=_setup_add_rms_norm)
