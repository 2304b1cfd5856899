"""Wiring a schedule to a rank: its program, its stages, its channels, its executor.

```python
setup = PipelineSetup.create(ctx, schedule_config, num_microbatches)  # collective: creates P2P groups
modules = {info.current_stage: provider.build_stage(info) for info in setup.local_stages}
executor = setup.executor(modules)
```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.runtime.channels import P2PChannels, pipeline_groups, program_channels
from d9d.pipeline.runtime.executor import PipelineExecutor
from d9d.pipeline.schedule.config import ScheduleConfig, build_schedule
from d9d.pipeline.schedule.program import PipelineProgram


@dataclass
class PipelineSetup:
    ctx: DistributedContext
    program: PipelineProgram
    pp_rank: int
    channels: P2PChannels | None
    pp_group: dist.ProcessGroup | None

    @classmethod
    def create(
        cls, ctx: DistributedContext, schedule: ScheduleConfig, num_microbatches: int
    ) -> PipelineSetup:
        """Compile the schedule for this mesh; every rank of the world must call it (it creates groups)."""
        pp = ctx.params.pipeline_parallel
        program = build_schedule(schedule, pp, num_microbatches)
        pp_rank = ctx.coordinates(MeshDomain.REGULAR)["pp"]
        if pp == 1:
            return cls(ctx, program, pp_rank, None, None)
        mesh = ctx.mesh_for(MeshDomain.REGULAR)
        channels = P2PChannels.create(pipeline_groups(mesh), program_channels(program), ctx.device)
        return cls(ctx, program, pp_rank, channels, mesh["pp"].get_group())

    @property
    def local_stages(self) -> list[PipelineStageInfo]:
        """The stages this rank must build (several for interleaved and V schedules)."""
        n = self.program.num_stages
        return [PipelineStageInfo(s, n) for s in self.program.placement.stages_of(self.pp_rank)]

    def executor(self, stages: Mapping[int, nn.Module]) -> PipelineExecutor:
        return PipelineExecutor(
            self.program,
            stages,
            pp_rank=self.pp_rank,
            device=self.ctx.device,
            channels=self.channels,
            pp_group=self.pp_group,
        )
