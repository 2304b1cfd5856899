"""The instructions a pipeline program is made of.

A program is, per rank, a flat list of actions. Compute actions name a (stage, microbatch) pair (or an
overlapped pair of them); communication actions name one transfer of a stage's tensors between two ranks.
The executor posts each run of consecutive communication actions as one batch of async P2P operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ComputeKind(StrEnum):
    FORWARD = "F"
    BACKWARD = "B"
    """Full backward: input and weight gradients in one pass."""
    BACKWARD_INPUT = "I"
    """Input gradients only (dI); the stage keeps what the weight pass needs."""
    BACKWARD_WEIGHT = "W"
    """Weight gradients (dW) of a microbatch whose input gradients were computed before."""


class Direction(StrEnum):
    FORWARD = "F"
    """Activations, from stage s to stage s + 1."""
    BACKWARD = "B"
    """Gradients of those activations, from stage s + 1 back to stage s."""


@dataclass(frozen=True)
class Compute:
    kind: ComputeKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"


@dataclass(frozen=True)
class Overlapped:
    """A forward and a backward of different microbatches issued as one unit (DualPipeV), so that one's
    communication can hide behind the other's compute. Inputs of both must be there before it starts."""

    forward: Compute
    backward: Compute

    def __post_init__(self) -> None:
        if self.forward.kind is not ComputeKind.FORWARD:
            raise ValueError(f"overlapped pair needs a forward first, got {self.forward}")
        if self.backward.kind not in (ComputeKind.BACKWARD, ComputeKind.BACKWARD_INPUT):
            raise ValueError(f"overlapped pair needs a full or input backward second, got {self.backward}")

    @property
    def parts(self) -> tuple[Compute, Compute]:
        return (self.forward, self.backward)

    def __str__(self) -> str:
        return f"{self.forward}+{self.backward}"


@dataclass(frozen=True)
class Transfer:
    """One tensor set crossing a stage boundary: `direction` F carries `src_stage`'s outputs to the next
    stage, B carries the gradients of `dst_stage`'s outputs back from `src_stage` = `dst_stage` + 1."""

    direction: Direction
    src_stage: int
    microbatch: int

    @property
    def dst_stage(self) -> int:
        return self.src_stage + 1 if self.direction is Direction.FORWARD else self.src_stage - 1

    def __str__(self) -> str:
        return f"{self.direction.value}[{self.src_stage}->{self.dst_stage}].{self.microbatch}"


@dataclass(frozen=True)
class Send:
    transfer: Transfer
    peer: int

    def __str__(self) -> str:
        return f"send {self.transfer} to {self.peer}"


@dataclass(frozen=True)
class Recv:
    transfer: Transfer
    peer: int

    def __str__(self) -> str:
        return f"recv {self.transfer} from {self.peer}"


ComputeAction = Compute | Overlapped
CommAction = Send | Recv
Action = Compute | Overlapped | Send | Recv


def compute_parts(action: ComputeAction) -> tuple[Compute, ...]:
    return action.parts if isinstance(action, Overlapped) else (action,)
