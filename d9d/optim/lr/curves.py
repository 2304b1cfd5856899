"""Curve shapes a phase follows from its start multiplier to its target."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Curve(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LinearCurve(_Curve):
    type: Literal["linear"] = "linear"

    def interpolate(self, start: float, end: float, t: float) -> float:
        return start + (end - start) * t


class CosineCurve(_Curve):
    """Half a cosine wave: flat at both ends, steepest in the middle."""

    type: Literal["cosine"] = "cosine"

    def interpolate(self, start: float, end: float, t: float) -> float:
        return end + (start - end) * (1.0 + math.cos(math.pi * t)) / 2.0


class ExponentialCurve(_Curve):
    """Geometric interpolation: a constant ratio per step, so both endpoints must be positive."""

    type: Literal["exponential"] = "exponential"

    def interpolate(self, start: float, end: float, t: float) -> float:
        return float(start * (end / start) ** t)


class PolynomialCurve(_Curve):
    """`end + (start - end) * (1 - t) ** power`: power 1 is linear, larger powers move early."""

    type: Literal["polynomial"] = "polynomial"
    power: float = Field(1.0, gt=0)

    def interpolate(self, start: float, end: float, t: float) -> float:
        return float(end + (start - end) * (1.0 - t) ** self.power)


Curve = Annotated[LinearCurve | CosineCurve | ExponentialCurve | PolynomialCurve, Field(discriminator="type")]
CurveName = Literal["linear", "cosine", "exponential", "polynomial"]
CurveLike = CurveName | LinearCurve | CosineCurve | ExponentialCurve | PolynomialCurve

_BY_NAME: dict[str, type[LinearCurve | CosineCurve | ExponentialCurve | PolynomialCurve]] = {
    "linear": LinearCurve,
    "cosine": CosineCurve,
    "exponential": ExponentialCurve,
    "polynomial": PolynomialCurve,
}


def to_curve(curve: CurveLike) -> LinearCurve | CosineCurve | ExponentialCurve | PolynomialCurve:
    """A curve from its name (default parameters) or as given."""
    if isinstance(curve, str):
        if curve not in _BY_NAME:
            raise ValueError(f"curve={curve!r} must be one of {sorted(_BY_NAME)} or a curve config")
        return _BY_NAME[curve]()
    return curve
