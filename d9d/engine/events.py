"""A typed event bus around each phase of a step.

Providers, tasks and users subscribe to the events they care about (e.g. log per-expert token counts after
forward/backward, update an EMA after the optimizer step) without the loop knowing about them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from d9d.core.storage import Location


@dataclass(frozen=True)
class StepStarted:
    step: int


@dataclass(frozen=True)
class ForwardBackwardFinished:
    step: int
    loss_sum: float
    weight: float


@dataclass(frozen=True)
class OptimizerStepFinished:
    step: int
    grad_norm: float | None  # before clipping
    lr: float  # the learning rate this step ran with


@dataclass(frozen=True)
class StepSkipped:
    """A step's loss or gradient norm was not finite and its update was dropped (`trainer.on_nonfinite`:
    skip), or the run went back to its newest commit (rollback: `rolled_back_to` is that step). Published
    instead of `OptimizerStepFinished`; state accumulated for the update (e.g. MoE router load) is dropped."""

    step: int
    reason: str
    rolled_back_to: int | None = None


@dataclass(frozen=True)
class StepRepeated:
    """A step's forward and backward ran again on the same microbatches before any update (an expert
    exchange overflowed its static capacity, `d9d.engine.exchange`); state accumulated for the update in
    the dropped pass (e.g. MoE router load) is dropped."""

    step: int
    reason: str


@dataclass(frozen=True)
class StepFinished:
    step: int
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointSaved:
    step: int
    path: Location


@dataclass(frozen=True)
class TrainingFinished:
    step: int
    status: str


E = TypeVar("E")


class EventBus:
    def __init__(self) -> None:
        self._handlers: dict[type[Any], list[Callable[[Any], None]]] = defaultdict(list)

    def subscribe(self, event_type: type[E], handler: Callable[[E], None]) -> None:
        self._handlers[event_type].append(handler)

    def publish(self, event: object) -> None:
        for handler in self._handlers.get(type(event), ()):
            handler(event)
