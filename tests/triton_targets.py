"""Compiling Triton kernels for a GPU on a machine without one (CI has no GPU).

The interpreter runs a kernel's Python, not Triton's compiler: code it accepts can still fail to lower
(types of loop-carried values, branches, layouts). Compiling down to a cubin for an H100 (sm_90) with the
ptxas Triton ships catches that on CPU. On a machine with CUDA the `gpu` tests launch the kernels instead.
"""

from __future__ import annotations

import pytest
import torch

needs_no_gpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA the gpu-marked tests compile and launch the kernels"
)


def compile_for_h100(fn: object, signature: dict[str, str], constexprs: dict[str, object]) -> None:
    """Compile `fn` (a `@triton.jit` function) for sm_90; raises on any front-end or back-end error."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"], f"no cubin for {fn}"
