"""Declarative description of the 6D parallel layout.

Validation happens here, at config time, so a bad layout fails before any process group exists.
"""

from __future__ import annotations

import math
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Physical rank layout, outermost first. Every domain in `DistributedContext` is a permutation and
# reshape of this grid, so a rank's coordinate in one domain is always consistent with every other.
PHYSICAL_DIMS: tuple[str, ...] = (
    "pp",
    "dp_replicate",
    "dp_shard",
    "cp_replicate",
    "cp_shard",
    "tp",
)


class DeviceMeshParameters(BaseModel):
    """Sizes of each parallel dimension; their product is the world size.

    `expert_parallel` is not a physical dimension of its own: experts are sharded over a slice of the
    non-pipeline ranks, so it must divide dp_replicate × dp_shard × cp_replicate × cp_shard × tp.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    pipeline_parallel: int = Field(1, ge=1)
    data_parallel_replicate: int = Field(1, ge=1)
    data_parallel_shard: int = Field(1, ge=1)
    context_parallel_replicate: int = Field(1, ge=1)
    context_parallel_shard: int = Field(1, ge=1)
    tensor_parallel: int = Field(1, ge=1)
    expert_parallel: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return math.prod(self.physical_sizes)

    @property
    def physical_sizes(self) -> tuple[int, ...]:
        return (
            self.pipeline_parallel,
            self.data_parallel_replicate,
            self.data_parallel_shard,
            self.context_parallel_replicate,
            self.context_parallel_shard,
            self.tensor_parallel,
        )

    @property
    def data_parallel(self) -> int:
        return self.data_parallel_replicate * self.data_parallel_shard

    @property
    def context_parallel(self) -> int:
        return self.context_parallel_replicate * self.context_parallel_shard

    @property
    def non_pipeline_size(self) -> int:
        """Ranks inside one pipeline stage: the pool experts are sharded over."""
        return self.data_parallel * self.context_parallel * self.tensor_parallel

    @property
    def expert_replicate(self) -> int:
        return self.non_pipeline_size // self.expert_parallel

    @property
    def experts_are_dense_weights(self) -> bool:
        """Without expert and tensor parallelism the experts are parallelized as weights of their block
        (FSDP shards them with it) instead of on the expert mesh, where they would be replicated on every
        data-parallel rank with their optimizer state."""
        return self.expert_parallel == 1 and self.tensor_parallel == 1

    @model_validator(mode="after")
    def _check_expert_parallel(self) -> Self:
        if self.non_pipeline_size % self.expert_parallel != 0:
            raise ValueError(
                f"expert_parallel={self.expert_parallel} must divide data_parallel_replicate × "
                "data_parallel_shard × context_parallel_replicate × context_parallel_shard × "
                f"tensor_parallel "
                f"= {self.data_parallel_replicate}×{self.data_parallel_shard}×"
                f"{self.context_parallel_replicate}×{self.context_parallel_shard}×{self.tensor_parallel} "
                f"= {self.non_pipeline_size}"
            )
        return self

    def check_world_size(self, world_size: int) -> None:
        """Raise if this layout cannot run on `world_size` ranks, naming every field's value."""
        if self.world_size != world_size:
            fields = ", ".join(
                f"{name}={getattr(self, name)}"
                for name in (
                    "pipeline_parallel",
                    "data_parallel_replicate",
                    "data_parallel_shard",
                    "context_parallel_replicate",
                    "context_parallel_shard",
                    "tensor_parallel",
                )
            )
            raise ValueError(
                f"mesh product {self.world_size} ({fields}) does not equal world size {world_size}"
            )
