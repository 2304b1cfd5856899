"""Schedule configuration: a discriminated union on `kind`, resolved by `build_schedule`.

Each config knows how many stages a rank holds (what the model provider must build) and checks, for a pp size
and microbatch count, that the schedule can run them, so a bad combination fails while the job config is
validated rather than at the first step.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from d9d.pipeline.schedule.builders.common import Orders
from d9d.pipeline.schedule.builders.dualpipev import dualpipev_orders
from d9d.pipeline.schedule.builders.interleaved import interleaved_orders
from d9d.pipeline.schedule.builders.one_f_one_b import one_f_one_b_orders, zb1p_orders
from d9d.pipeline.schedule.builders.simple import gpipe_orders, inference_orders
from d9d.pipeline.schedule.builders.zbv import zbv_orders
from d9d.pipeline.schedule.placement import StagePlacement
from d9d.pipeline.schedule.program import PipelineProgram, add_communication


class _Schedule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    stages_per_rank: int = 1

    @property
    def training(self) -> bool:
        return True

    def placement(self, pp_size: int) -> StagePlacement:
        return StagePlacement.looped(pp_size, self.stages_per_rank)

    def check(self, pp_size: int, num_microbatches: int) -> None:
        """Raise ValueError naming the problem when this schedule cannot run pp_size ranks × microbatches."""
        if pp_size < 1:
            raise ValueError(f"pipeline_parallel must be >= 1, got {pp_size}")
        if num_microbatches < 1:
            raise ValueError(f"the number of microbatches must be >= 1, got {num_microbatches}")

    def _orders(self, pp_size: int, num_microbatches: int) -> Orders:
        raise NotImplementedError


class InferenceSchedule(_Schedule):
    """Forward only: each rank runs every microbatch through its stages. For evaluation and generation."""

    kind: Literal["inference"] = "inference"
    stages_per_rank: int = Field(default=1, ge=1)

    @property
    def training(self) -> bool:
        return False

    def _orders(self, pp_size: int, num_microbatches: int) -> Orders:
        return inference_orders(pp_size, num_microbatches, self.stages_per_rank)


class GPipeSchedule(_Schedule):
    """All forwards, then all backwards. Simple; holds every microbatch's activations."""

    kind: Literal["gpipe"] = "gpipe"
    stages_per_rank: Literal[1] = 1

    def _orders(self, pp_size: int, num_microbatches: int) -> Orders:
        return gpipe_orders(pp_size, num_microbatches)


class OneFOneBSchedule(_Schedule):
    """1F1B: at most pp - rank microbatches in flight; bubble (p - 1) / (m + p - 1)."""

    kind: Literal["1f1b"] = "1f1b"
    stages_per_rank: Literal[1] = 1

    def _orders(self, pp_size: int, num_microbatches: int) -> Orders:
        return one_f_one_b_orders(pp_size, num_microbatches)


class Interleaved1F1BSchedule(_Schedule):
    """Looped placement with several stages per rank; bubble divided by about `stages_per_rank`."""

    kind: Literal["interleaved_1f1b"] = "interleaved_1f1b"
    stages_per_rank: int = Field(default=2, ge=2)

    def check(self, pp_size: int, num_microbatches: int) -> None:
        super().check(pp_size, num_microbatches)
        if num_microbatches % pp_size != 0:
            raise ValueError(
                f"interleaved_1f1b needs the number of microbatches ({num_microbatches}) to be a multiple of "
                f"pipeline_parallel ({pp_size})"
            )

    def _orders(self, pp_size: int, num_microbatches: int) -> Orders:
        return interleaved_orders(pp_size, num_microbatches, self.stages_per_rank)


class ZB1PSchedule(_Schedule):
    """1F1B with split backward; weight passes fill the bubbles (about a third of 1F1B's when F = I = W)."""

    kind: Literal["zb1p"] = "zb1p"
    stages_per_rank: Literal[1] = 1

    def _orders(self, pp_size: int, num_microbatches: int) -> Orders:
        return zb1p_orders(pp_size, num_microbatches)


class _VSchedule(_Schedule):
    stages_per_rank: Literal[2] = 2

    def placement(self, pp_size: int) -> StagePlacement:
        return StagePlacement.v_shape(pp_size)


class ZBVSchedule(_VSchedule):
    """Zero-bubble V: two stages per rank in a V, split backward; each rank idles only the p - 1 slots of the
    way-down fill, so the bubble is near zero once m >= 2p. Any m >= 1 runs."""

    kind: Literal["zbv"] = "zbv"

    def _orders(self, pp_size: int, num_microbatches: int) -> Orders:
        return zbv_orders(pp_size, num_microbatches)


class DualPipeVSchedule(_VSchedule):
    """DualPipeV: V placement with overlapped forward/backward pairs in the steady state."""

    kind: Literal["dualpipev"] = "dualpipev"

    def check(self, pp_size: int, num_microbatches: int) -> None:
        super().check(pp_size, num_microbatches)
        if num_microbatches < 2 * pp_size - 1:
            raise ValueError(
                f"dualpipev needs at least 2 × pipeline_parallel - 1 = {2 * pp_size - 1} microbatches, got "
                f"{num_microbatches}"
            )

    def _orders(self, pp_size: int, num_microbatches: int) -> Orders:
        return dualpipev_orders(pp_size, num_microbatches)


ScheduleConfig = Annotated[
    InferenceSchedule
    | GPipeSchedule
    | OneFOneBSchedule
    | Interleaved1F1BSchedule
    | ZB1PSchedule
    | ZBVSchedule
    | DualPipeVSchedule,
    Field(discriminator="kind"),
]


def build_schedule(config: ScheduleConfig, pp_size: int, num_microbatches: int) -> PipelineProgram:
    """Compile `config` into the per-rank programs of a pp_size × num_microbatches step."""
    config.check(pp_size, num_microbatches)
    placement = config.placement(pp_size)
    orders = config._orders(pp_size, num_microbatches)
    return PipelineProgram(
        name=config.kind,
        placement=placement,
        num_microbatches=num_microbatches,
        training=config.training,
        actions=add_communication(orders, placement),
    )
