"""Length bucketing inside a shuffling buffer.

Padding a microbatch to its longest sample wastes compute in proportion to the length spread, and packing
fits best when neighbours are alike. Sorting the whole dataset by length would fix that but ruin the
shuffle (all short samples first), so the sort is local:

1. each epoch, shuffle all indices (seeded by `seed` and the epoch);
2. cut the shuffled order into buffers of `buffer_size`;
3. inside a buffer, sort by length and cut into packs of `pack_size` neighbours of similar length;
4. shuffle the packs of the buffer, so long and short packs alternate.

Consecutive runs of `pack_size` samples therefore have similar lengths while the dataset is still visited
in a random order. The order is a pure function of (seed, epoch), so positions are resumable by index.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sized
from typing import Any, Generic, TypeVar

import torch

from d9d.data.protocols import SizedDataset, Stateful
from d9d.data.state import check_state_matches
from d9d.determinism.seeds import mix_seed

T = TypeVar("T")


def token_count(sample: Any) -> int:
    """Default length: `len(sample["input_ids"])` for dict samples, `len(sample)` otherwise."""
    if isinstance(sample, Mapping):
        return len(sample["input_ids"])
    if isinstance(sample, Sized):
        return len(sample)
    raise TypeError(f"cannot take the length of a {type(sample).__name__} sample; pass length_fn")


def _generator(*parts: int | str) -> torch.Generator:
    return torch.Generator().manual_seed(mix_seed(*parts))


class BufferSortedDataset(Generic[T]):
    """A per-epoch permutation of `dataset` with length-bucketed packs (see the module doc).

    `pack_size` is typically the number of samples that end up side by side: the microbatch size, or
    `dp_size × microbatch_size` when a sequentially sharded stream deals consecutive samples to DP ranks.
    Each buffer's samples are fetched once and kept while it is being read; with several DataLoader
    workers every worker builds the buffers it touches.
    """

    def __init__(
        self,
        dataset: SizedDataset[T],
        *,
        buffer_size: int,
        pack_size: int,
        seed: int,
        length_fn: Callable[[T], int] = token_count,
    ) -> None:
        if pack_size < 1:
            raise ValueError(f"pack_size={pack_size} must be >= 1")
        if buffer_size < pack_size or buffer_size % pack_size:
            raise ValueError(
                f"buffer_size={buffer_size} must be a positive multiple of pack_size={pack_size}"
            )
        self.dataset = dataset
        self.buffer_size = buffer_size
        self.pack_size = pack_size
        self.seed = seed
        self.length_fn = length_fn
        self.epoch = 0
        self._perm: torch.Tensor | None = None
        self._buffer_id = -1
        self._buffer_order: list[int] = []
        self._buffer_samples: dict[int, T] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self._perm = None
            self._buffer_id = -1

    def _permutation(self) -> torch.Tensor:
        if self._perm is None:
            self._perm = torch.randperm(
                len(self.dataset), generator=_generator(self.seed, "shuffle", self.epoch)
            )
        return self._perm

    def _load_buffer(self, buffer_id: int) -> None:
        start = buffer_id * self.buffer_size
        members = self._permutation()[start : start + self.buffer_size].tolist()
        samples = {idx: self.dataset[idx] for idx in members}
        # Stable sort: equal lengths keep their shuffled order, so ties do not bias the result.
        by_length = sorted(members, key=lambda idx: -self.length_fn(samples[idx]))
        packs = [by_length[i : i + self.pack_size] for i in range(0, len(by_length), self.pack_size)]
        # Only the dataset's last buffer can end in a short pack; it stays last so packs stay aligned.
        full = len(by_length) // self.pack_size
        shuffled = torch.randperm(
            full, generator=_generator(self.seed, "packs", self.epoch, buffer_id)
        ).tolist()
        self._buffer_order = [idx for p in [*shuffled, *range(full, len(packs))] for idx in packs[p]]
        self._buffer_samples = samples
        self._buffer_id = buffer_id

    def source_index(self, index: int) -> int:
        """Which index of the wrapped dataset sits at `index` this epoch."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        buffer_id, offset = divmod(index, self.buffer_size)
        if buffer_id != self._buffer_id:
            self._load_buffer(buffer_id)
        return self._buffer_order[offset]

    def __getitem__(self, index: int) -> T:
        source = self.source_index(index)  # may load the next buffer: look it up afterwards
        return self._buffer_samples[source]

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "buffer_size": self.buffer_size,
            "pack_size": self.pack_size,
            "length": len(self),
        }

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {**self._fingerprint(), "epoch": self.epoch}
        if isinstance(self.dataset, Stateful):
            state["dataset"] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_matches("buffer-sorted dataset", state, self._fingerprint())
        if isinstance(self.dataset, Stateful):
            self.dataset.load_state_dict(state["dataset"])
        self.set_epoch(int(state["epoch"]))
