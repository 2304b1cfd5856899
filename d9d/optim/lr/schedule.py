"""A schedule resolved against a step count: absolute segments, evaluated in closed form."""

from __future__ import annotations

from dataclasses import dataclass

from d9d.optim.lr.curves import CosineCurve, ExponentialCurve, LinearCurve, PolynomialCurve


@dataclass(frozen=True)
class Segment:
    """Steps `[start, end)` move from `start_value` toward `end_value` along `curve`."""

    start: int
    end: int
    start_value: float
    end_value: float
    curve: LinearCurve | CosineCurve | ExponentialCurve | PolynomialCurve

    def value(self, step: int) -> float:
        return self.curve.interpolate(
            self.start_value, self.end_value, (step - self.start) / (self.end - self.start)
        )


@dataclass(frozen=True)
class PiecewiseSchedule:
    """LR multiplier per optimizer step.

    Step 0 (before the first update) gets `initial_multiplier`; the step where a phase ends gets exactly
    its target; after the last phase the last target holds. A zero-length phase is a jump to its target.
    """

    initial_multiplier: float
    segments: tuple[Segment, ...]

    @property
    def end(self) -> int:
        return self.segments[-1].end if self.segments else 0

    @property
    def final_multiplier(self) -> float:
        return self.segments[-1].end_value if self.segments else self.initial_multiplier

    def multiplier(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        for segment in self.segments:
            if segment.start <= step < segment.end:
                return segment.value(step)
        return self.final_multiplier
