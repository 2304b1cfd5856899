"""Which rank holds which stage.

Looped placement puts stage s on rank s mod p (one stage per rank is the plain case). V placement gives rank r
the stages r and 2p - 1 - r: the last rank holds the two middle stages, so the turn from the way down to the
way up costs no communication, and rank 0 holds both the embedding and the loss.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePlacement:
    num_ranks: int
    stage_ranks: tuple[int, ...]
    """`stage_ranks[s]` is the rank holding stage s."""

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        bad = [s for s, r in enumerate(self.stage_ranks) if not 0 <= r < self.num_ranks]
        if bad:
            raise ValueError(f"stages {bad} are placed outside ranks [0, {self.num_ranks})")
        empty = [r for r in range(self.num_ranks) if r not in self.stage_ranks]
        if empty:
            raise ValueError(f"ranks {empty} hold no stage")

    @classmethod
    def looped(cls, num_ranks: int, stages_per_rank: int = 1) -> StagePlacement:
        if stages_per_rank < 1:
            raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
        return cls(num_ranks, tuple(s % num_ranks for s in range(num_ranks * stages_per_rank)))

    @classmethod
    def v_shape(cls, num_ranks: int) -> StagePlacement:
        down = tuple(range(num_ranks))
        return cls(num_ranks, down + tuple(reversed(down)))

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def rank_of(self, stage: int) -> int:
        return self.stage_ranks[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)
