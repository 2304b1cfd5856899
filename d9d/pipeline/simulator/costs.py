"""How long each kind of action takes in a simulation (arbitrary time units)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from d9d.pipeline.schedule.actions import Compute, ComputeAction, ComputeKind, Overlapped


class ActionCosts(BaseModel):
    """Costs per stage and microbatch. Unit costs (F = I = W = 1, B = I + W) give the textbook bubble
    formulas."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    forward: float = Field(default=1.0, gt=0)
    backward_input: float = Field(default=1.0, gt=0)
    backward_weight: float = Field(default=1.0, gt=0)
    backward_full: float | None = Field(default=None, gt=0)
    """Full backward; defaults to backward_input + backward_weight."""
    overlap_factor: float = Field(default=1.0, gt=0, le=1)
    """An overlapped forward+backward pair costs this fraction of the sum of its parts (1: no gain)."""
    communication: float = Field(default=0.0, ge=0)
    """Latency of one transfer once both ends have posted it."""

    def of(self, action: ComputeAction) -> float:
        if isinstance(action, Overlapped):
            return self.overlap_factor * (self.of(action.forward) + self.of(action.backward))
        return self._compute(action)

    def _compute(self, part: Compute) -> float:
        match part.kind:
            case ComputeKind.FORWARD:
                return self.forward
            case ComputeKind.BACKWARD_INPUT:
                return self.backward_input
            case ComputeKind.BACKWARD_WEIGHT:
                return self.backward_weight
            case ComputeKind.BACKWARD:
                if self.backward_full is not None:
                    return self.backward_full
                return self.backward_input + self.backward_weight
