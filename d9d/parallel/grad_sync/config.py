"""Settings of the gradient synchronizer."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

GradDTypeName = Literal["float32", "bfloat16", "float16", "float64"]


class GradSyncConfig(BaseModel):
    """`bucket_size_mb`: the largest bucket (in MiB of gradient data); smaller buckets start reducing
    earlier in backward, larger ones make fewer, more efficient collectives.

    `grad_dtype`: the dtype gradients are accumulated over microbatches and all-reduced in (e.g. float32
    for bf16 parameters); None keeps each parameter's dtype. A parameter whose strategy reduces it wider
    (FSDP with `reduce_dtype: float32`, recorded by `mark_grad_reduce_dtype`) gets at least that dtype. The
    optimizer always sees gradients in the parameter's dtype. Under pipelining, and where FSDP reduces
    once per step (`fsdp.reduce_every`), FSDP accumulates a step's microbatches itself, in its reduce
    dtype: a wider `grad_dtype` there needs FSDP's `reduce_dtype` at least as wide (the engine refuses the
    job otherwise; `reduce_every: auto` then reduces every microbatch).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket_size_mb: float = Field(25.0, gt=0)
    grad_dtype: GradDTypeName | None = None

    def resolve_grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return param_dtype if self.grad_dtype is None else getattr(torch, self.grad_dtype)

    def accumulates_wider(self, param_dtype: torch.dtype, than: torch.dtype | None) -> bool:
        """Whether a `param_dtype` gradient accumulates here wider than in `than` (None: the parameter's own
        dtype), e.g. than where FSDP accumulates it when it reduces once per step."""
        return self.resolve_grad_dtype(param_dtype).itemsize > (than or param_dtype).itemsize
