"""Fluent construction of a piecewise schedule, e.g. warmup, plateau, cosine decay, cooldown.

    piecewise_schedule(initial_multiplier=0.0)
        .for_steps(100, 1.0, curve="linear")
        .until_percentage(0.9, 0.1, curve="cosine")
        .fill_rest(0.0)
        .build(optimizer, total_steps=1000)

Each call returns a new builder, so a shared prefix can be extended in several ways.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.optim import Optimizer

from d9d.optim.lr.config import PercentagePhase, Phase, PiecewiseScheduleConfig, RestPhase, StepsPhase
from d9d.optim.lr.curves import CurveLike, to_curve
from d9d.optim.lr.schedule import PiecewiseSchedule
from d9d.optim.lr.scheduler import PiecewiseLR


@dataclass(frozen=True)
class PiecewiseScheduleBuilder:
    initial_multiplier: float
    phases: tuple[Phase, ...] = ()

    def _then(self, phase: Phase) -> PiecewiseScheduleBuilder:
        return PiecewiseScheduleBuilder(self.initial_multiplier, (*self.phases, phase))

    def for_steps(self, steps: int, target: float, curve: CurveLike = "linear") -> PiecewiseScheduleBuilder:
        return self._then(StepsPhase(steps=steps, target=target, curve=to_curve(curve)))

    def until_percentage(
        self, until: float, target: float, curve: CurveLike = "linear"
    ) -> PiecewiseScheduleBuilder:
        return self._then(PercentagePhase(until=until, target=target, curve=to_curve(curve)))

    def fill_rest(self, target: float, curve: CurveLike = "linear") -> PiecewiseScheduleBuilder:
        return self._then(RestPhase(target=target, curve=to_curve(curve)))

    def config(self) -> PiecewiseScheduleConfig:
        """The validated config form (what a YAML file would hold)."""
        return PiecewiseScheduleConfig(initial_multiplier=self.initial_multiplier, phases=self.phases)

    def resolve(self, total_steps: int | None = None) -> PiecewiseSchedule:
        return self.config().resolve(total_steps)

    def build(self, optimizer: Optimizer, total_steps: int | None = None) -> PiecewiseLR:
        return PiecewiseLR(optimizer, self.resolve(total_steps))


def piecewise_schedule(initial_multiplier: float = 1.0) -> PiecewiseScheduleBuilder:
    """Start a schedule at `initial_multiplier` × each group's base LR."""
    return PiecewiseScheduleBuilder(initial_multiplier)
