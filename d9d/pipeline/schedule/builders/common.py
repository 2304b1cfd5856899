"""Shorthands the schedule builders share."""

from __future__ import annotations

from d9d.pipeline.schedule.actions import Compute, ComputeAction, ComputeKind

Orders = list[list[ComputeAction]]
"""Per rank, the compute actions in the order the rank runs them."""


def fwd(stage: int, mb: int) -> Compute:
    return Compute(ComputeKind.FORWARD, stage, mb)


def bwd(stage: int, mb: int) -> Compute:
    return Compute(ComputeKind.BACKWARD, stage, mb)


def bwd_input(stage: int, mb: int) -> Compute:
    return Compute(ComputeKind.BACKWARD_INPUT, stage, mb)


def bwd_weight(stage: int, mb: int) -> Compute:
    return Compute(ComputeKind.BACKWARD_WEIGHT, stage, mb)
