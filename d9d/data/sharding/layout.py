"""How a pool of P samples is dealt to n shards, and what n shards have consumed after k lockstep rounds.

- `sequential`: shard r takes pool positions r, r+n, r+2n, ... — consecutive samples go to different
  ranks, so the global stream advances as a prefix (this is what keeps "the global position" meaningful).
  With `block` b > 1 the pool is dealt in runs of b: shard r takes positions [(r + kn)·b, (r + kn + 1)·b)
  in round k, so b neighbours (a length-bucketed pack) stay together on one rank while the stream still
  advances as a prefix of n·b per round. A last, partial round is split evenly (`chunked`-style), or sits
  out with `drop`.
- `chunked`: shard r takes a contiguous block — neighbours stay on one rank (useful when neighbours were
  bucketed together), and the global position is one run per shard.

Uneven pools (P not a multiple of n):
- `keep`: shards differ in length by at most one; every sample is dealt exactly once.
- `pad`: short shards repeat a sample from the start of the pool so all have the same length
  (the repeats are the only duplicates).
- `drop`: the last P mod n samples are left out of this pass so all have the same length; with `block` b,
  the last P mod n·b (the partial round), so every shard's pass is whole runs: a shard reading several
  passes back to back then starts each pass on a run boundary, and its runs stay aligned.

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
    block: int = 1

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards={self.num_shards} must be >= 1")
        if self.mode not in ("sequential", "chunked"):
            raise ValueError(f"mode={self.mode!r} must be 'sequential' or 'chunked'")
        if self.uneven not in ("keep", "pad", "drop"):
            raise ValueError(f"uneven={self.uneven!r} must be 'keep', 'pad' or 'drop'")
        if self.block < 1:
            raise ValueError(f"block={self.block} must be >= 1")
        if self.block != 1 and self.mode != "sequential":
            raise ValueError(
                f"block={self.block} needs mode='sequential' (chunked shards are one block each)"
            )

    @property
    def _base(self) -> int:
        return self.pool_size // self.num_shards

    @property
    def _extra(self) -> int:
        return self.pool_size % self.num_shards

    @property
    def _full(self) -> int:
        """Sequential mode: samples each shard takes in the complete rounds of `block`-sized runs."""
        return self.pool_size // (self.num_shards * self.block) * self.block

    def _split(self, offset: int, size: int, shard: int) -> Span:
        """The shard's even, contiguous share of `size` pool positions from `offset`."""
        base, extra = divmod(size, self.num_shards)
        if self.uneven == "drop":
            return offset + shard * base, offset + (shard + 1) * base
        start = offset + shard * base + min(shard, extra)
        return start, start + base + int(shard < extra)

    def _chunk(self, shard: int) -> Span:
        if self.mode == "sequential":  # the last, partial round
            dealt = self.num_shards * self._full
            return self._split(dealt, 0 if self.uneven == "drop" else self.pool_size - dealt, shard)
        return self._split(0, self.pool_size, shard)

    def length(self, shard: int) -> int:
        if self.uneven == "drop":
            return self._full if self.mode == "sequential" else self._base
        if self.uneven == "pad":
            return self._base + int(self._extra > 0)
        return self._base + int(shard < self._extra)

    def position(self, shard: int, i: int) -> int:
        """Pool position of the shard's `i`-th sample."""
        if not 0 <= i < self.length(shard):
            raise IndexError(f"index {i} out of range for shard {shard} of length {self.length(shard)}")
        offset = 0
        if self.mode == "sequential":
            if i < self._full:
                run, within = divmod(i, self.block)
                return (run * self.num_shards + shard) * self.block + within
            offset = self._full
        start, stop = self._chunk(shard)
        if start + i - offset < stop:
            return start + i - offset
        # The single padding slot of a short shard: spread over the pool's first samples.
        return (shard - self._extra) % self.pool_size

    def consumed(self, rounds: int) -> list[Span]:
        """Pool positions dealt out once every shard has taken `rounds` samples (or all of its own)."""
        if rounds <= 0:
            return []
        if self.uneven == "pad" and rounds >= self.length(0):
            return [(0, self.pool_size)] if self.pool_size else []
        spans = []
        offset = 0
        if self.mode == "sequential":
            runs, within = divmod(min(rounds, self._full), self.block)
            spans.append((0, runs * self.num_shards * self.block))
            for shard in range(self.num_shards):  # a run every shard has only started (block > 1)
                start = (runs * self.num_shards + shard) * self.block
                spans.append((start, start + within))
            offset = self._full
        for shard in range(self.num_shards):
            start, stop = self._chunk(shard)
            spans.append((start, min(stop, start + max(rounds - offset, 0))))
        return merge_spans(spans)
