"""The declarative form of a piecewise schedule; the builder produces the same objects."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.optim.lr.curves import Curve, ExponentialCurve, LinearCurve
from d9d.optim.lr.schedule import PiecewiseSchedule, Segment


class _Phase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    target: float = Field(ge=0, allow_inf_nan=False, description="multiplier reached when the phase ends")
    curve: Curve = Field(default_factory=LinearCurve)


class StepsPhase(_Phase):
    """Lasts a fixed number of steps."""

    kind: Literal["steps"] = "steps"
    steps: int = Field(ge=1)


class PercentagePhase(_Phase):
    """Lasts until a fraction of the total steps (rounded to the nearest step)."""

    kind: Literal["percentage"] = "percentage"
    until: float = Field(gt=0, le=1)


class RestPhase(_Phase):
    """Lasts until the total steps; only as the last phase."""

    kind: Literal["rest"] = "rest"


Phase = Annotated[StepsPhase | PercentagePhase | RestPhase, Field(discriminator="kind")]


class PiecewiseScheduleConfig(BaseModel):
    """An LR multiplier schedule: phases in order, each from the previous target to its own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["piecewise"] = "piecewise"
    initial_multiplier: float = Field(1.0, ge=0, allow_inf_nan=False)
    phases: tuple[Phase, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_phases(self) -> PiecewiseScheduleConfig:
        last_until: tuple[int, float] | None = None
        start_value = self.initial_multiplier
        for i, phase in enumerate(self.phases):
            if isinstance(phase, RestPhase) and i != len(self.phases) - 1:
                raise ValueError(f"phases[{i}]: a 'rest' phase must be the last phase")
            if isinstance(phase, PercentagePhase):
                if last_until is not None and phase.until <= last_until[1]:
                    raise ValueError(
                        f"phases[{i}].until={phase.until} must be greater than "
                        f"phases[{last_until[0]}].until={last_until[1]}"
                    )
                last_until = (i, phase.until)
            if isinstance(phase.curve, ExponentialCurve) and not (start_value > 0 and phase.target > 0):
                raise ValueError(
                    f"phases[{i}].curve: exponential needs positive endpoints, "
                    f"got {start_value} -> {phase.target}"
                )
            start_value = phase.target
        return self

    @property
    def needs_total_steps(self) -> bool:
        return any(not isinstance(phase, StepsPhase) for phase in self.phases)

    def resolve(self, total_steps: int | None = None) -> PiecewiseSchedule:
        """Absolute segments for a run of `total_steps` (optional when every phase counts steps)."""
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1")
        if total_steps is None and self.needs_total_steps:
            first = next(i for i, p in enumerate(self.phases) if not isinstance(p, StepsPhase))
            raise ValueError(
                f"total_steps is required: phases[{first}] is a {self.phases[first].kind!r} phase"
            )
        segments = []
        cursor, value = 0, self.initial_multiplier
        for i, phase in enumerate(self.phases):
            if isinstance(phase, StepsPhase):
                end = cursor + phase.steps
            elif isinstance(phase, PercentagePhase):
                assert total_steps is not None
                end = round(phase.until * total_steps)
                if end < cursor:
                    raise ValueError(
                        f"phases[{i}].until={phase.until} ends at step {end} (of {total_steps}), before the "
                        f"previous phases end at step {cursor}: phases overlap"
                    )
            else:
                assert total_steps is not None
                end = total_steps
            if total_steps is not None and end > total_steps:
                raise ValueError(f"phases[{i}] ends at step {end}, beyond total_steps={total_steps}")
            segments.append(Segment(cursor, end, value, phase.target, phase.curve))
            cursor, value = end, phase.target
        return PiecewiseSchedule(self.initial_multiplier, tuple(segments))
