"""Buffer-sorted bucketing: a shuffled permutation whose packs are length-sorted slices of each buffer."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from d9d.data.bucketing import BufferSortedDataset
from d9d.data.sharding import ShardedDataset


def _samples(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    rng = random.Random(seed)
    return [{"input_ids": torch.full((rng.randint(1, 200),), i)} for i in range(n)]


def _ids(ds: BufferSortedDataset) -> list[int]:
    return [int(ds[i]["input_ids"][0]) for i in range(len(ds))]


@pytest.mark.parametrize(
    ("n", "buffer_size", "pack_size"), [(103, 20, 4), (64, 64, 8), (50, 12, 3), (7, 8, 2)]
)
def test_packs_are_length_sorted_slices_of_each_buffer(n: int, buffer_size: int, pack_size: int) -> None:
    data = _samples(n)
    lengths = [len(s["input_ids"]) for s in data]
    ds = BufferSortedDataset(data, buffer_size=buffer_size, pack_size=pack_size, seed=3)
    order = _ids(ds)
    assert sorted(order) == list(range(n))  # a permutation: nothing lost or repeated
    for start in range(0, n, buffer_size):
        buffer = order[start : start + buffer_size]
        packs = [buffer[i : i + pack_size] for i in range(0, len(buffer), pack_size)]
        # Reference: sort the buffer's lengths; packs, ordered by their longest member, must tile it.
        by_longest = sorted(packs, key=lambda p: -max(lengths[i] for i in p))
        tiled = [lengths[i] for p in by_longest for i in sorted(p, key=lambda i: -lengths[i])]
        assert tiled == sorted((lengths[i] for i in buffer), reverse=True)


def test_bucketing_reduces_padding() -> None:
    data = _samples(400, seed=1)
    lengths = [len(s["input_ids"]) for s in data]

    def padding(order: list[int], pack: int) -> int:
        return sum(
            max(lengths[i] for i in order[s : s + pack]) * len(order[s : s + pack])
            - sum(lengths[i] for i in order[s : s + pack])
            for s in range(0, len(order), pack)
        )

    bucketed = _ids(BufferSortedDataset(data, buffer_size=96, pack_size=8, seed=0))
    shuffled = list(range(400))
    random.Random(0).shuffle(shuffled)
    assert padding(bucketed, 8) < 0.25 * padding(shuffled, 8)


def test_order_depends_on_seed_and_epoch_only() -> None:
    data = _samples(60)
    a = BufferSortedDataset(data, buffer_size=20, pack_size=4, seed=1)
    b = BufferSortedDataset(data, buffer_size=20, pack_size=4, seed=1)
    c = BufferSortedDataset(data, buffer_size=20, pack_size=4, seed=2)
    assert _ids(a) == _ids(b) != _ids(c)
    epoch0 = _ids(a)
    a.set_epoch(1)
    assert _ids(a) != epoch0 and sorted(_ids(a)) == sorted(epoch0)
    a.set_epoch(0)
    assert _ids(a) == epoch0
    # Random access in any order gives the same samples as a sequential read.
    positions = list(range(60))
    random.Random(5).shuffle(positions)
    assert {p: int(a[p]["input_ids"][0]) for p in positions} == dict(enumerate(epoch0))


def test_exact_resume_through_the_stream_across_epochs() -> None:
    data = _samples(45)

    def stream() -> ShardedDataset:
        inner = BufferSortedDataset(data, buffer_size=10, pack_size=5, seed=9)
        return ShardedDataset(inner, num_shards=1, shard_index=0, epochs=3)

    full = [int(s["input_ids"][0]) for s in stream()]
    for k in (0, 17, 45, 60):
        first = stream()
        it = iter(first)
        consumed = [int(next(it)["input_ids"][0]) for _ in range(k)]
        resumed = stream()
        resumed.load_state_dict(first.state_dict())
        assert consumed + [int(s["input_ids"][0]) for s in resumed] == full
    epochs = [full[i : i + 45] for i in range(0, 135, 45)]
    assert all(sorted(e) == list(range(45)) for e in epochs) and epochs[0] != epochs[1]


def test_resume_with_different_settings_is_refused() -> None:
    data = _samples(30)
    state = BufferSortedDataset(data, buffer_size=10, pack_size=5, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        BufferSortedDataset(data, buffer_size=10, pack_size=5, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="buffer_size"):
        BufferSortedDataset(data, buffer_size=20, pack_size=5, seed=1).load_state_dict(state)


@pytest.mark.parametrize(("buffer_size", "pack_size"), [(10, 0), (10, 3), (2, 4)])
def test_bad_sizes(buffer_size: int, pack_size: int) -> None:
    with pytest.raises(ValueError, match="pack_size"):
        BufferSortedDataset(_samples(5), buffer_size=buffer_size, pack_size=pack_size, seed=0)


def test_custom_length_fn_on_plain_samples() -> None:
    words = ["a" * n for n in (5, 1, 9, 3, 7, 2, 8, 4)]
    ds = BufferSortedDataset(words, buffer_size=8, pack_size=2, seed=0, length_fn=len)
    order = [ds[i] for i in range(8)]
    packs = [sorted(len(w) for w in order[i : i + 2]) for i in range(0, 8, 2)]
    assert sorted(packs) == [[1, 2], [3, 4], [5, 7], [8, 9]]
    assert list(itertools.chain(*sorted(packs))) == sorted(len(w) for w in words)
