"""The small traits every d9d dataset building block speaks.

Datasets are *map-style*: a length and random access by index, deterministic given their configuration
(and epoch, for shuffling ones). Random access is what makes exact resume and DP re-sharding cheap: a
position in the stream is just an index, so nothing has to be replayed. The one stateful cursor lives in
the outermost per-rank layer (`ShardedDataset`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class SizedDataset(Protocol[T_co]):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> T_co: ...


@runtime_checkable
class Stateful(Protocol):
    """Saved into checkpoints; `load_state_dict` refuses a state that does not fit (naming the key)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class EpochAware(Protocol):
    """A dataset whose order depends on the epoch (e.g. a reshuffle); told by the cursor when one starts."""

    def set_epoch(self, epoch: int) -> None: ...
