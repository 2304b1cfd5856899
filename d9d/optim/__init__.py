"""Training toolkit: piecewise LR schedules and the stochastic-rounding AdamW."""

from d9d.optim.lr import (
    PiecewiseLR,
    PiecewiseSchedule,
    PiecewiseScheduleBuilder,
    PiecewiseScheduleConfig,
    build_piecewise_lr,
    piecewise_schedule,
    plot_schedule,
)
from d9d.optim.stochastic import StochasticAdamW

__all__ = [
    "PiecewiseLR",
    "PiecewiseSchedule",
    "PiecewiseScheduleBuilder",
    "PiecewiseScheduleConfig",
    "StochasticAdamW",
    "build_piecewise_lr",
    "piecewise_schedule",
    "plot_schedule",
]
