"""SwiGLU's gate as `torch.library` custom ops, so a compiled region calls the kernel without a graph break.

Backward saves only gate and up (the op's inputs) and recomputes the sigmoid. The ops run the Triton
kernels on GPUs and under the Triton interpreter; on a CPU without the interpreter they run the same math
in PyTorch. Triton is imported on first use.
"""

# The custom-op schema is read from these annotations at decoration time: no postponed annotations here.
# Every output is contiguous (the fake implementations say so), whatever the inputs' strides.

import torch

from d9d.kernels.backend import triton_launches_on as kernel_runs
from d9d.kernels.swiglu.reference import swiglu_backward_torch, swiglu_forward_torch


@torch.library.custom_op("d9d::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if kernel_runs(gate.device):
        from d9d.kernels.swiglu.triton_kernels import swiglu_forward_triton

        return swiglu_forward_triton(gate, up)
    return swiglu_forward_torch(gate.contiguous(), up.contiguous())


@swiglu_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("d9d::swiglu_backward", mutates_args=())
def swiglu_backward_op(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if kernel_runs(gate.device):
        from d9d.kernels.swiglu.triton_kernels import swiglu_backward_triton

        return swiglu_backward_triton(grad_out, gate, up)
    return swiglu_backward_torch(grad_out.contiguous(), gate.contiguous(), up.contiguous())


@swiglu_backward_op.register_fake
def _(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup(
    ctx: torch.autograd.function.FunctionCtx, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor
) -> None:
    ctx.save_for_backward(*inputs)


def _backward(
    ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = ctx.saved_tensors  # type: ignore[attr-defined]
    grad_gate, grad_up = swiglu_backward_op(grad_out, gate, up)
    return grad_gate, grad_up


swiglu_op.register_autograd(_backward, setup_context=_setup)
