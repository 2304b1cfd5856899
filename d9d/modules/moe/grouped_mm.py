"""Grouped matrix multiplication: one matmul per expert over contiguous row groups, several kernels."""

from __future__ import annotations

import importlib.util
import os
from typing import Literal, Protocol, get_args

import torch

GroupedMMName = Literal["auto", "torch", "grouped_gemm", "eager"]
GROUPED_MM_ENV = "D9D_GROUPED_MM"


class GroupedMM(Protocol):
    """`x` [rows, in] grouped by expert, `weight` [experts, in, out], `counts` [experts] → [rows, out].

    Rows past `counts.sum()` are padding (an exchange with a static capacity sends them): no expert
    computes them and their output rows are unspecified (zero in the host-sized kernels below)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...


class EagerGroupedMM:
    """A Python loop of dense matmuls: the portable reference (syncs once to read the group sizes)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        sizes = counts.tolist()
        groups = x.split([*sizes, x.shape[0] - sum(sizes)])
        outs = [group @ weight[e] for e, group in enumerate(groups[:-1])]
        outs.append(x.new_zeros(groups[-1].shape[0], weight.shape[-1]))  # the padding rows
        return torch.cat(outs)


class TorchGroupedMM:
    """`torch._grouped_mm`: one kernel for all experts, no host sync (CUTLASS on CUDA sm90+)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = counts.cumsum(0).to(torch.int32)
        out: torch.Tensor = torch._grouped_mm(x, weight, offs=offsets)
        return out


class GroupedGemmMM:
    """The `grouped_gemm` package's CUTLASS kernel (expects group sizes on the host)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        from grouped_gemm.ops import gmm

        sizes = counts.to("cpu", torch.int64)
        total = int(sizes.sum())
        out: torch.Tensor = gmm(x[:total], weight, sizes, trans_b=False)
        if total < x.shape[0]:  # padding rows
            out = torch.cat([out, out.new_zeros(x.shape[0] - total, out.shape[1])])
        return out


def torch_grouped_mm_preferred(x: torch.Tensor) -> bool:
    """`torch._grouped_mm` is the fast path on Hopper and newer with bf16 inputs."""
    return x.is_cuda and x.dtype == torch.bfloat16 and _hopper_or_newer(x.device.index or 0)


# A compiled MoE block asks this on every trace: dynamo takes the answer as a constant instead of tracing
# the device query (which it cannot put in a graph: a break per block, and later blocks run eager).
@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]  # untyped in torch
def _hopper_or_newer(device_index: int) -> bool:
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device_index) >= (9, 0)


def grouped_gemm_usable(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and importlib.util.find_spec("grouped_gemm") is not None


class AutoGroupedMM:
    """Per call, the fastest kernel that supports the input: torch (sm90+), grouped_gemm, else the loop."""

    def __init__(self) -> None:
        self._torch = TorchGroupedMM()
        self._grouped_gemm = GroupedGemmMM()
        self._eager = EagerGroupedMM()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if torch_grouped_mm_preferred(x):
            return self._torch(x, weight, counts)
        if grouped_gemm_usable(x):
            return self._grouped_gemm(x, weight, counts)
        return self._eager(x, weight, counts)


def build_grouped_mm(name: GroupedMMName = "auto") -> GroupedMM:
    """Resolves a backend name; `auto` honours the `D9D_GROUPED_MM` environment override first."""
    if name == "auto":
        override = os.environ.get(GROUPED_MM_ENV, "auto")
        if override not in get_args(GroupedMMName):
            raise ValueError(f"{GROUPED_MM_ENV}={override!r} is not one of {list(get_args(GroupedMMName))}")
        name = override  # type: ignore[assignment]  # validated just above
    if name == "torch":
        if not hasattr(torch, "_grouped_mm"):
            raise ValueError(
                f"grouped-mm backend 'torch' needs torch._grouped_mm (torch {torch.__version__})"
            )
        return TorchGroupedMM()
    if name == "grouped_gemm":
        if importlib.util.find_spec("grouped_gemm") is None:
            raise ValueError("grouped-mm backend 'grouped_gemm' requested but the package is not installed")
        return GroupedGemmMM()
    if name == "eager":
        return EagerGroupedMM()
    return AutoGroupedMM()
