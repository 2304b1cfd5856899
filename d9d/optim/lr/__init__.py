"""Piecewise LR schedules: phases by steps, fraction of the run, or the rest; pluggable curves."""

from d9d.optim.lr.builder import PiecewiseScheduleBuilder, piecewise_schedule
from d9d.optim.lr.config import PercentagePhase, Phase, PiecewiseScheduleConfig, RestPhase, StepsPhase
from d9d.optim.lr.curves import CosineCurve, Curve, ExponentialCurve, LinearCurve, PolynomialCurve
from d9d.optim.lr.plot import plot_schedule
from d9d.optim.lr.schedule import PiecewiseSchedule, Segment
from d9d.optim.lr.scheduler import PiecewiseLR, build_piecewise_lr

__all__ = [
    "CosineCurve",
    "Curve",
    "ExponentialCurve",
    "LinearCurve",
    "PercentagePhase",
    "Phase",
    "PiecewiseLR",
    "PiecewiseSchedule",
    "PiecewiseScheduleBuilder",
    "PiecewiseScheduleConfig",
    "PolynomialCurve",
    "RestPhase",
    "Segment",
    "StepsPhase",
    "build_piecewise_lr",
    "piecewise_schedule",
    "plot_schedule",
]
