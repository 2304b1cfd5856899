"""Which world sizes a job may run at.

Only the data-parallel degree is elastic: pipeline, context, tensor and expert parallelism fix the size of
one data-parallel replica, so valid world sizes are multiples of it. A size is valid when the mesh built
for it is valid (expert parallelism still divides the non-pipeline ranks) and the global batch still
splits into whole microbatches on every data-parallel rank; gradient accumulation then rises as the
degree shrinks, so the global batch (and with it the sample order) never changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from d9d.core.mesh_params import DeviceMeshParameters
from d9d.engine.config import BatchingConfig
from d9d.engine.launch import with_data_parallel


@dataclass(frozen=True)
class WorldPlan:
    world_size: int
    data_parallel: int
    mesh: DeviceMeshParameters
    gradient_accumulation: int


def replica_size(mesh: DeviceMeshParameters) -> int:
    """Ranks in one data-parallel replica: the unit the world grows and shrinks by."""
    return mesh.world_size // mesh.data_parallel


def plan_for(mesh: DeviceMeshParameters, batching: BatchingConfig, workers: int) -> WorldPlan:
    """The layout for exactly `workers` ranks; ValueError says why it cannot exist."""
    unit = replica_size(mesh)
    if workers % unit != 0:
        raise ValueError(
            f"{workers} workers is not a multiple of the {unit} ranks one data-parallel replica needs "
            f"(pipeline × context × tensor parallel of the mesh)"
        )
    dp = workers // unit
    try:
        resized = with_data_parallel(mesh, dp)
    except ValidationError as e:
        raise ValueError(f"data parallel {dp} gives an invalid mesh: {e.errors()[0]['msg']}") from None
    accumulation = batching.gradient_accumulation(dp)
    return WorldPlan(workers, dp, resized, accumulation)


def valid_plans(
    mesh: DeviceMeshParameters, batching: BatchingConfig, min_workers: int, max_workers: int
) -> list[WorldPlan]:
    """Every valid layout with min_workers..max_workers ranks, largest first."""
    plans = []
    for workers in range(max_workers, min_workers - 1, -1):
        try:
            plans.append(plan_for(mesh, batching, workers))
        except ValueError:
            continue
    return plans
