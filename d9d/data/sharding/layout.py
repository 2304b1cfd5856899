"""How a pool of P samples is dealt to n shards, and what n shards have consumed after k lockstep rounds.

- `sequential`: shard r takes pool positions r, r+n, r+2n, ... — consecutive samples go to different
  ranks, so the global stream advances as a prefix (this is what keeps "the global position" meaningful).
- `chunked`: shard r takes a contiguous block — neighbours stay on one rank (useful when neighbours were
  bucketed together), and the global position is one run per shard.

Uneven pools (P not a multiple of n):
- `keep`: shards differ in length by at most one; every sample is dealt exactly once.
- `pad`: short shards repeat a sample from the start of the pool so all have the same length
  (the repeats are the only duplicates).
- `drop`: the last P mod n samples are left out of this pass so all have the same length.

All ranks of a data-parallel job consume in lockstep (one step = the same number of samples on every
rank), so "k rounds consumed" describes the whole job's progress; that is what a re-shard needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from d9d.data.sharding.ranges import Span, merge_spans

ShardingMode = Literal["sequential", "chunked"]
UnevenPolicy = Literal["keep", "pad", "drop"]


@dataclass(frozen=True)
class ShardLayout:
    pool_size: int
    num_shards: int
    mode: ShardingMode
    uneven: UnevenPolicy

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards={self.num_shards} must be >= 1")
        if self.mode not in ("sequential", "chunked"):
            raise ValueError(f"mode={self.mode!r} must be 'sequential' or 'chunked'")
        if self.uneven not in ("keep", "pad", "drop"):
            raise ValueError(f"uneven={self.uneven!r} must be 'keep', 'pad' or 'drop'")

    @property
    def _base(self) -> int:
        return self.pool_size // self.num_shards

    @property
    def _extra(self) -> int:
        return self.pool_size % self.num_shards

    def _chunk(self, shard: int) -> Span:
        if self.uneven == "drop":
            return shard * self._base, (shard + 1) * self._base
        start = shard * self._base + min(shard, self._extra)
        return start, start + self._base + int(shard < self._extra)

    def length(self, shard: int) -> int:
        if self.uneven == "drop":
            return self._base
        if self.uneven == "pad":
            return self._base + int(self._extra > 0)
        return self._base + int(shard < self._extra)

    def position(self, shard: int, i: int) -> int:
        """Pool position of the shard's `i`-th sample."""
        if not 0 <= i < self.length(shard):
            raise IndexError(f"index {i} out of range for shard {shard} of length {self.length(shard)}")
        if self.mode == "sequential":
            return (shard + self.num_shards * i) % self.pool_size
        start, stop = self._chunk(shard)
        if start + i < stop:
            return start + i
        # The single padding slot of a short chunk: spread over the pool's first samples.
        return (shard - self._extra) % self.pool_size

    def consumed(self, rounds: int) -> list[Span]:
        """Pool positions dealt out once every shard has taken `rounds` samples (or all of its own)."""
        if rounds <= 0:
            return []
        if self.uneven == "pad" and rounds >= self.length(0):
            return [(0, self.pool_size)] if self.pool_size else []
        if self.mode == "sequential":
            dealt = self.num_shards * self._base if self.uneven == "drop" else self.pool_size
            return merge_spans([(0, min(self.num_shards * rounds, dealt))])
        spans = []
        for shard in range(self.num_shards):
            start, stop = self._chunk(shard)
            spans.append((start, min(stop, start + rounds)))
        return merge_spans(spans)
