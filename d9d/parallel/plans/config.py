"""Choices of a parallelization plan that a job config sets (the mesh sizes live in DeviceMeshParameters)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from d9d.parallel.expert import AutoBackendConfig, ExpertCommunicationConfig


class ParallelPlanConfig(BaseModel):
    """- `sequence_parallel`: shard the residual stream along the sequence between tensor-parallel blocks.
    - `expert_backend`: token exchange of expert parallelism (`auto`: DeepEP where it can run).
    - `fsdp_reshard_after_forward`: free gathered FSDP weights after forward (re-gather in backward).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    sequence_parallel: bool = False
    expert_backend: ExpertCommunicationConfig = Field(default_factory=AutoBackendConfig)
    fsdp_reshard_after_forward: bool = True
