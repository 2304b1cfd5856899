"""RMSNorm forward and backward in Triton, optionally with the residual add fused in front.

Forward: each program normalizes a tile of `BLOCK_M` whole rows (the row length fits one block), reading
the input (and the residual) once and writing the output (and the sum) once, with float32 statistics and
one rounding at the end; it keeps the per-row `rstd` for backward. Backward: each program walks a
contiguous range of rows, writes their input gradient (plus the gradient that reached the sum directly,
for the fused add) and accumulates its partial weight gradient in float32; the partials ([programs, N])
are summed afterwards, so no atomics and a deterministic result. Importing this module imports Triton;
`TRITON_INTERPRET=1` must be set before the import to run the kernels on CPU tensors.
"""

# Triton reads a kernel's parameter annotations as argument types, so kernels stay unannotated and keep
# Triton's upper-case constexpr naming.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# ruff: noqa: ANN001, ANN202, N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The largest row the single-block kernels take; wider rows stay on the reference (see `unsupported`).
MAX_N = 65536
# Elements per tile: rows are stacked until a tile holds about this many, so narrow rows (the per-head
# q/k norms, 128 wide) do not get one program each.
_TILE = 4096
# Backward programs: enough to fill the GPU, few enough that the [programs, N] partials stay small.
_BWD_PROGRAMS_CUDA_PER_SM = 4
_BWD_PROGRAMS_CPU = 4


@triton.jit
def _forward_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    rstd_ptr,
    rows,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok = row < rows
    mask = row_ok[:, None] & (cols < N)[None, :]
    offsets = row[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + offsets, mask=mask, other=0.0)
        # round the sum to its stored dtype first: the norm sees exactly the residual stream it returns
        x = (x.to(tl.float32) + res.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offsets, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    out = x * rstd[:, None] * w[None, :]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd, mask=row_ok)


@triton.jit
def _backward_kernel(
    grad_out_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    grad_sum_ptr,
    grad_x_ptr,
    grad_w_partial_ptr,
    rows,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ITERS: tl.constexpr,
    HAS_GRAD_SUM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    grad_w = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid.to(tl.int64) * (ITERS * BLOCK_M)
    for i in range(ITERS):
        row = first + i * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = row < rows
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = row[:, None] * N + cols[None, :]
        dy = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        mean_gx = tl.sum(g * xhat, axis=1) / N
        dx = rstd[:, None] * (g - xhat * mean_gx[:, None])
        if HAS_GRAD_SUM:
            dx += tl.load(grad_sum_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_x_ptr + offsets, dx.to(grad_x_ptr.dtype.element_ty), mask=mask)
        grad_w += dy * xhat
    tl.store(grad_w_partial_ptr + pid.to(tl.int64) * N + cols, tl.sum(grad_w, axis=0), mask=col_ok)


def _blocks(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_M, num_warps): wide rows get more warps so a thread holds at most ~32 values."""
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(64, _TILE // block_n))
    return block_n, block_m, min(16, max(4, block_n * block_m // 1024))


def rms_norm_forward_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(output, sum or None, rstd [rows] float32) for `x` [..., N] (contiguous), normalized over N."""
    n = x.shape[-1]
    x = x.contiguous()
    rows = x.numel() // n if n else 0
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if rows:
        block_n, block_m, warps = _blocks(n)
        _forward_kernel[(triton.cdiv(rows, block_m),)](
            x,
            residual.contiguous() if residual is not None else x,
            weight.contiguous(),
            out,
            total if total is not None else out,
            rstd,
            rows,
            eps,
            N=n,
            BLOCK_N=block_n,
            BLOCK_M=block_m,
            HAS_RESIDUAL=residual is not None,
            ZERO_CENTERED=zero_centered,
            num_warps=warps,
        )
    return out, total, rstd


def _backward_programs(device: torch.device, tiles: int) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return min(tiles, sms * _BWD_PROGRAMS_CUDA_PER_SM)
    return min(tiles, _BWD_PROGRAMS_CPU)


def rms_norm_backward_triton(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    grad_sum: torch.Tensor | None,
    zero_centered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x [+ grad_sum], grad_weight). `x` is what was normalized (the sum, for the fused add)."""
    n = x.shape[-1]
    x = x.contiguous()
    rows = x.numel() // n if n else 0
    grad_x = torch.empty_like(x)
    if not rows:
        return grad_x, torch.zeros_like(weight)
    block_n, block_m, warps = _blocks(n)
    tiles = triton.cdiv(rows, block_m)
    programs = _backward_programs(x.device, tiles)
    # tiles per program, rounded up to a power of two so a handful of sequence lengths share a compile
    iters = triton.next_power_of_2(triton.cdiv(tiles, programs))
    programs = triton.cdiv(tiles, iters)
    partial = torch.empty(programs, n, dtype=torch.float32, device=x.device)
    _backward_kernel[(programs,)](
        grad_out.contiguous(),
        x,
        weight.contiguous(),
        rstd.contiguous(),
        grad_sum.contiguous() if grad_sum is not None else grad_x,
        grad_x,
        partial,
        rows,
        N=n,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        ITERS=iters,
        HAS_GRAD_SUM=grad_sum is not None,
        ZERO_CENTERED=zero_centered,
        num_warps=warps,
    )
    return grad_x, partial.sum(0).to(weight.dtype)
