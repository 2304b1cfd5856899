"""Choices of a parallelization plan that a job config sets (the mesh sizes live in DeviceMeshParameters)."""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.parallel.context.config import ContextAttention
from d9d.parallel.expert import AutoBackendConfig, ExpertCommunicationConfig
from d9d.parallel.fsdp import FSDPConfig
from d9d.pipeline.split import EvenSplit, StageSplitConfig


class ParallelPlanConfig(BaseModel):
    """- `sequence_parallel`: shard the residual stream along the sequence between tensor-parallel blocks.
    - `expert_backend`: token exchange of expert parallelism (`auto`: all-to-all; DeepEP by `kind: deep_ep`).
    - `fsdp`: how FSDP gathers and reduces when the mesh shards (`reshard_after_forward`, `reduce_dtype`,
      `forward_prefetch`, `backward_prefetch`; see `FSDPConfig` and docs/parallelism.md).
    - `context_attention`: how attention spans a sequence split over the cp ranks (`allgather`; `ring` is
      reserved and rejected until it is implemented, see docs/parallelism.md).
    - `stage_split`: which decoder layers each pipeline stage holds: `even` (default; equal layer counts,
      embedding and head one layer each), `layers` (the counts, in stage order) or `flops` (stages of equal
      FLOPs by the family's cost model, attention at `seq_len`; `d9d.pipeline.split` says when it helps).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    sequence_parallel: bool = False
    expert_backend: ExpertCommunicationConfig = Field(default_factory=AutoBackendConfig)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    context_attention: ContextAttention = "allgather"
    stage_split: StageSplitConfig = Field(default_factory=EvenSplit)

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "fsdp_reshard_after_forward" in data:
            raise ValueError(
                "fsdp_reshard_after_forward was replaced by fsdp.reshard_after_forward: 'always' (was true), "
                "'never' (was false) or 'auto' (the default; see docs/parallelism.md)"
            )
        return data

    @model_validator(mode="after")
    def _check_context_attention(self) -> Self:
        if self.context_attention == "ring":
            raise ValueError(
                "context_attention='ring' is not implemented yet; use 'allgather' (keys/values gathered over "
                "the cp ranks per layer)"
            )
        return self
