"""Choices of a parallelization plan that a job config sets (the mesh sizes live in DeviceMeshParameters)."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.parallel.context.config import ContextAttention
from d9d.parallel.expert import AutoBackendConfig, ExpertCommunicationConfig


class ParallelPlanConfig(BaseModel):
    """- `sequence_parallel`: shard the residual stream along the sequence between tensor-parallel blocks.
    - `expert_backend`: token exchange of expert parallelism (`auto`: DeepEP where it can run).
    - `fsdp_reshard_after_forward`: free gathered FSDP weights after forward (re-gather in backward).
    - `context_attention`: how attention spans a sequence split over the cp ranks (`allgather`; `ring` is
      reserved and rejected until it is implemented, see docs/parallelism.md).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    sequence_parallel: bool = False
    expert_backend: ExpertCommunicationConfig = Field(default_factory=AutoBackendConfig)
    fsdp_reshard_after_forward: bool = True
    context_attention: ContextAttention = "allgather"

    @model_validator(mode="after")
    def _check_context_attention(self) -> Self:
        if self.context_attention == "ring":
            raise ValueError(
                "context_attention='ring' is not implemented yet; use 'allgather' (keys/values gathered over "
                "the cp ranks per layer)"
            )
        return self
