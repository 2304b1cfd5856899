"""The engine's own state, as pieces that save and load themselves.

A checkpoint holds, besides model and optimizer (DCP, `d9d.engine.checkpoint`):

- `engine.pt` (written by rank 0, read by every rank): the training progress (`step`, `losses`), the world
  size it was written under, the LR schedulers' states and the data position;
- `rank-<r>.pt` (one per rank): RNG streams, the task metrics' accumulators and the expert exchange's
  capacities, restored only under the same world size (an elastic restart cannot map RNG streams onto a new
  set of ranks).

Each piece is `Stateful`-like (`state_dict` / `load_state_dict`); `EngineState` only assembles them under
their keys, so adding a piece never touches the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from d9d.determinism import capture_rng_state, restore_rng_state
from d9d.pipeline.optim import PipelinedLRScheduler


class Piece(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class TrainProgress:
    """The loop's global (not per-microbatch) progress."""

    step: int = 0
    losses: list[float] = field(default_factory=list)

    def finish_step(self, step: int, loss: float) -> None:
        self.step = step
        self.losses.append(loss)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": list(self.losses)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.losses = list(state.get("losses", []))


class SchedulerStates:
    """The LR schedulers' states as a list in stage order (empty without a scheduler)."""

    def __init__(self, schedulers: PipelinedLRScheduler | None) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> list[dict[str, Any]]:
        return self.schedulers.positional_state() if self.schedulers is not None else []

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        if self.schedulers is not None:
            self.schedulers.load_positional_state(state)
        elif state:
            raise ValueError(
                f"the checkpoint holds {len(state)} LR scheduler states but this run has no lr_scheduler"
            )


class RngState:
    """Every RNG stream of this process (Python, NumPy, torch CPU and device)."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng_state(state)


class WorldSize:
    """Saved so a restart can tell whether per-rank state still belongs to the same ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def state_dict(self) -> int:
        return self.world_size

    def load_state_dict(self, state: int) -> None:
        return None  # informational: the current world size is a fact of this run


class EngineState:
    """The shared pieces (rank 0 writes them) and the per-rank pieces, by checkpoint key."""

    def __init__(
        self,
        progress: TrainProgress,
        world_size: int,
        schedulers: PipelinedLRScheduler | None,
        data: Piece,
        metrics: Piece | None,
        exchange: Piece | None = None,
    ) -> None:
        self.progress = progress
        self.world_size = world_size
        self.shared: dict[str, Piece] = {
            "world_size": WorldSize(world_size),
            "schedulers": SchedulerStates(schedulers),
            "data": data,
        }
        # What a rerun of a step after an exchange overflow restores too (d9d.engine.exchange).
        self.per_rank: dict[str, Piece] = {"rng": RngState()}
        if metrics is not None:
            self.per_rank["metrics"] = metrics
        # Per rank too, but kept through a rerun (the capacities it grew are the point of the rerun).
        self.per_rank_checkpointed: dict[str, Piece] = {} if exchange is None else {"exchange": exchange}

    def state_dict(self) -> dict[str, Any]:
        return {**self.progress.state_dict(), **{k: p.state_dict() for k, p in self.shared.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.progress.load_state_dict(state)
        for key, piece in self.shared.items():
            if key in state:
                piece.load_state_dict(state[key])

    def _rank_pieces(self) -> dict[str, Piece]:
        return {**self.per_rank, **self.per_rank_checkpointed}

    def rank_state_dict(self) -> dict[str, Any]:
        return {k: p.state_dict() for k, p in self._rank_pieces().items()}

    def load_rank_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, piece in self._rank_pieces().items():
            if key in state:
                piece.load_state_dict(state[key])
