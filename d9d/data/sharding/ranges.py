"""An ascending set of integers kept as half-open ranges.

A sharded stream's *pool* — the samples of the current pass not yet dealt out — starts as `[0, N)` and
after each DP re-shard loses the consumed positions. Consumption is always a few runs (a prefix, or one
run per old shard), so the pool stays a handful of ranges however large N is.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

Span = tuple[int, int]


def merge_spans(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint, non-empty spans covering the same integers."""
    out: list[Span] = []
    for start, stop in sorted(s for s in spans if s[0] < s[1]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def complement(spans: Sequence[Span], size: int) -> list[Span]:
    """`[0, size)` minus the (merged) `spans`."""
    out: list[Span] = []
    cursor = 0
    for start, stop in merge_spans(spans):
        if start > cursor:
            out.append((cursor, min(start, size)))
        cursor = max(cursor, stop)
    if cursor < size:
        out.append((cursor, size))
    return out


@dataclass(frozen=True)
class IndexRanges:
    spans: tuple[Span, ...]
    _ends: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ends", tuple(accumulate(stop - start for start, stop in self.spans)))

    @classmethod
    def full(cls, size: int) -> IndexRanges:
        return cls(((0, size),) if size > 0 else ())

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < len(self):
            raise IndexError(f"position {position} out of range for {len(self)} indices")
        k = bisect.bisect_right(self._ends, position)
        before = self._ends[k - 1] if k else 0
        return self.spans[k][0] + position - before

    def select(self, positions: Sequence[Span]) -> IndexRanges:
        """The indices at the given (merged) position spans, in order."""
        out: list[Span] = []
        for pstart, pstop in merge_spans(positions):
            pos = pstart
            while pos < min(pstop, len(self)):
                k = bisect.bisect_right(self._ends, pos)
                before = self._ends[k - 1] if k else 0
                start = self.spans[k][0] + pos - before
                take = min(pstop, self._ends[k]) - pos
                out.append((start, start + take))
                pos += take
        return IndexRanges(tuple(merge_spans(out)) if out else ())

    def to_list(self) -> list[list[int]]:
        return [[start, stop] for start, stop in self.spans]

    @classmethod
    def from_list(cls, spans: Sequence[Sequence[int]]) -> IndexRanges:
        return cls(tuple((int(s[0]), int(s[1])) for s in spans))
