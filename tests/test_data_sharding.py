"""DP sharding: exact partition, exact resume, and re-sharding that keeps the global position."""

from __future__ import annotations

import io
import itertools
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from d9d.core import all_gather_object
from d9d.data.sharding import IndexRanges, ShardedDataset
from d9d.data.sharding.ranges import complement, merge_spans
from tests.harness import RankEnv, run_distributed

SIZES = [1, 7, 10, 13, 16]
SHARDS = [1, 2, 3, 4, 5]
MODES = ["sequential", "chunked"]


def _shards(n_items: int, n: int, mode: str, uneven: str, **kw) -> list[ShardedDataset[int]]:
    data = list(range(n_items))
    return [
        ShardedDataset(data, num_shards=n, shard_index=r, mode=mode, uneven=uneven, **kw) for r in range(n)
    ]


def _reference_keep(n_items: int, n: int, mode: str) -> list[list[int]]:
    data = list(range(n_items))
    if mode == "sequential":
        return [data[r::n] for r in range(n)]
    return [chunk.tolist() for chunk in np.array_split(np.arange(n_items), n)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("n_items", "n"), list(itertools.product(SIZES, SHARDS)))
def test_keep_is_an_exact_partition(n_items: int, n: int, mode: str) -> None:
    got = [list(s) for s in _shards(n_items, n, mode, "keep")]
    assert got == _reference_keep(n_items, n, mode)
    assert sorted(itertools.chain(*got)) == list(range(n_items))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("n_items", "n"), list(itertools.product(SIZES, SHARDS)))
def test_pad_gives_equal_lengths_and_only_padding_repeats(n_items: int, n: int, mode: str) -> None:
    got = [list(s) for s in _shards(n_items, n, mode, "pad")]
    per_shard = -(-n_items // n)
    assert all(len(g) == per_shard for g in got)
    counts = Counter(itertools.chain(*got))
    assert set(counts) == set(range(n_items))  # nothing lost
    assert sum(counts.values()) - n_items == per_shard * n - n_items  # the only extras are the padding
    # Without the padding slots, the shards are exactly the `keep` partition.
    ref = _reference_keep(n_items, n, mode)
    assert [g[: len(r)] for g, r in zip(got, ref, strict=True)] == ref


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("n_items", "n"), list(itertools.product(SIZES, SHARDS)))
def test_drop_gives_equal_lengths_without_repeats(n_items: int, n: int, mode: str) -> None:
    got = [list(s) for s in _shards(n_items, n, mode, "drop")]
    assert all(len(g) == n_items // n for g in got)
    flat = list(itertools.chain(*got))
    assert len(set(flat)) == len(flat) == n * (n_items // n)
    assert sorted(flat) == list(range(n * (n_items // n)))  # the tail is what gets dropped


def _consume(stream: ShardedDataset[int], k: int) -> list[int]:
    it = iter(stream)
    return [next(it) for _ in range(k)]


def _roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uneven", ["pad", "drop"])
@pytest.mark.parametrize("k", [0, 3, 11, 25])
def test_exact_resume_mid_epoch_and_across_epochs(mode: str, uneven: str, k: int) -> None:
    kw = {"mode": mode, "uneven": uneven, "epochs": 4}
    original = ShardedDataset(list(range(23)), num_shards=3, shard_index=1, **kw)
    _consume(original, k)
    state = _roundtrip(original.state_dict())
    expected = list(original)
    resumed = ShardedDataset(list(range(23)), num_shards=3, shard_index=1, **kw)
    resumed.load_state_dict(state)
    assert list(resumed) == expected
    fresh = ShardedDataset(list(range(23)), num_shards=3, shard_index=1, **kw)
    assert list(fresh)[k:] == expected


def test_remaining_view_and_advance_match_iteration() -> None:
    stream = ShardedDataset(list(range(40)), num_shards=2, shard_index=1, uneven="pad", epochs=2)
    reference = list(ShardedDataset(list(range(40)), num_shards=2, shard_index=1, uneven="pad", epochs=2))
    got: list[int] = []
    while rest := stream.remaining():
        loader = DataLoader(rest, batch_size=3, num_workers=2)
        for batch in itertools.islice(loader, 2):  # a "step" of two batches, then resume from the cursor
            got.extend(batch.tolist())
            stream.advance(len(batch))
    assert got == reference
    with pytest.raises(ValueError, match="past the end"):
        stream.advance(1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uneven", ["keep", "pad", "drop"])
@pytest.mark.parametrize("rounds", [0, 2, 3, 4])
def test_every_shard_resumes_from_shard_zeros_state(mode: str, uneven: str, rounds: int) -> None:
    # 11 samples over 3 shards: shard lengths 4/4/3 (keep), so at rounds=4 shard 2 is already read out.
    old = _shards(11, 3, mode, uneven)
    _lockstep_consume(old, rounds)
    state = _roundtrip(old[0].state_dict())
    for original in old:
        resumed = ShardedDataset(
            list(range(11)), num_shards=3, shard_index=original.shard_index, mode=mode, uneven=uneven
        )
        resumed.load_state_dict(state)
        assert list(resumed) == list(original)


def test_loading_over_a_different_dataset_is_refused() -> None:
    state = _shards(10, 2, "sequential", "keep")[0].state_dict()
    with pytest.raises(ValueError, match="11"):
        ShardedDataset(list(range(11)), num_shards=2, shard_index=0).load_state_dict(state)


def test_reshard_refused_by_default_naming_the_change() -> None:
    state = _shards(20, 4, "sequential", "keep")[0].state_dict()
    new = ShardedDataset(list(range(20)), num_shards=2, shard_index=0)
    with pytest.raises(ValueError, match=r"num_shards=4→2.*keep_position"):
        new.load_state_dict(state)


def _lockstep_consume(shards: list[ShardedDataset[int]], rounds: int) -> list[int]:
    out: list[int] = []
    its = [iter(s) for s in shards]
    for _ in range(rounds):
        for it in its:
            out.extend(itertools.islice(it, 1))  # an exhausted shard just yields nothing
    return out


RESHARDS = [(4, 2), (2, 3), (3, 4), (4, 1), (1, 4), (3, 5)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("old_n", "new_n"), RESHARDS)
@pytest.mark.parametrize("rounds", [0, 2, 5])
def test_reshard_keeps_position_no_sample_lost_or_repeated(
    mode: str, old_n: int, new_n: int, rounds: int
) -> None:
    n_items = 29
    old = _shards(n_items, old_n, mode, "keep")
    before = _lockstep_consume(old, rounds)
    state = _roundtrip(old[0].state_dict())
    new = _shards(n_items, new_n, mode, "keep", on_reshard="keep_position")
    for s in new:
        s.load_state_dict(state)
    after = [list(s) for s in new]
    assert sorted(before + list(itertools.chain(*after))) == list(range(n_items))
    if mode == "sequential":
        # The global stream continues exactly where it stopped, dealt round-robin to the new shards.
        tail = list(range(n_items))[min(old_n * rounds, n_items) :]
        assert after == [tail[r::new_n] for r in range(new_n)]


@pytest.mark.parametrize("mode", MODES)
def test_chained_reshards_then_next_epoch(mode: str) -> None:
    n_items, epochs = 31, 2
    seen: list[int] = []
    old = _shards(n_items, 4, mode, "pad", epochs=epochs, on_reshard="keep_position")
    seen += _lockstep_consume(old, 3)
    mid = _shards(n_items, 2, mode, "pad", epochs=epochs, on_reshard="keep_position")
    for s in mid:
        s.load_state_dict(old[0].state_dict())
    seen += _lockstep_consume(mid, 4)
    last = _shards(n_items, 3, mode, "pad", epochs=epochs, on_reshard="keep_position")
    for s in last:
        s.load_state_dict(mid[0].state_dict())
    first_epoch_rest = [list(itertools.islice(iter(s), len(s) - s.position)) for s in last]
    epoch0 = seen + list(itertools.chain(*first_epoch_rest))
    assert set(epoch0) == set(range(n_items))  # nothing lost; repeats only from padding
    assert len(epoch0) - n_items < 3  # at most one padding slot per final shard
    # The next epoch starts over with the full dataset dealt to the current 3 shards.
    epoch1 = [list(s) for s in last]
    assert all(s.epoch == 1 for s in last)
    assert sorted(set(itertools.chain(*epoch1))) == list(range(n_items))


def test_index_ranges_against_python_lists() -> None:
    rng = random.Random(0)
    for _ in range(200):
        size = rng.randint(0, 60)
        spans = [(a, a + rng.randint(0, 8)) for a in (rng.randint(0, size) for _ in range(rng.randint(0, 5)))]
        covered = {x for a, b in spans for x in range(a, b)}
        assert [x for a, b in merge_spans(spans) for x in range(a, b)] == sorted(covered)
        comp = complement(spans, size)
        assert [x for a, b in comp for x in range(a, b)] == [x for x in range(size) if x not in covered]
        pool = IndexRanges(tuple(merge_spans([(a * 3, a * 3 + 2) for a in range(size // 3)])))
        as_list = [x for a, b in pool.spans for x in range(a, b)]
        assert [pool[i] for i in range(len(pool))] == as_list
        positions = merge_spans([(min(a, len(pool)), min(b, len(pool))) for a, b in spans])
        picked = pool.select(positions)
        assert [picked[i] for i in range(len(picked))] == [
            as_list[p] for a, b in positions for p in range(a, b)
        ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_shards": 2, "shard_index": 2}, "shard_index"),
        ({"num_shards": 2, "shard_index": 0, "epochs": 0}, "epochs"),
        ({"num_shards": 2, "shard_index": 0, "epochs": None}, "uneven='keep'"),
        ({"num_shards": 2, "shard_index": 0, "mode": "strided"}, "mode"),
        ({"num_shards": 2, "shard_index": 0, "on_reshard": "guess"}, "on_reshard"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShardedDataset(list(range(5)), **kwargs)


# -- the elastic flow on real ranks: 4 ranks save, 3 ranks resume from old shard 0's state -------------


def _old_job(env: RankEnv, n_items: int, rounds: int) -> None:
    stream = ShardedDataset(list(range(n_items)), num_shards=env.world_size, shard_index=env.rank)
    mine = _consume(stream, rounds)
    everyone = all_gather_object(mine)
    if env.rank == 0:
        torch.save(
            {"state": stream.state_dict(), "seen": [x for part in everyone for x in part]},
            env.tmp_dir / "ck.pt",
        )


def _new_job(env: RankEnv, n_items: int, ckpt: str) -> None:
    saved = torch.load(ckpt, weights_only=True)
    stream = ShardedDataset(
        list(range(n_items)), num_shards=env.world_size, shard_index=env.rank, on_reshard="keep_position"
    )
    stream.load_state_dict(saved["state"])
    everyone = all_gather_object(list(stream))
    total = saved["seen"] + [x for part in everyone for x in part]
    assert sorted(total) == list(range(n_items)), total


@pytest.mark.distributed
def test_elastic_shrink_on_gloo_ranks(tmp_path: Path) -> None:
    run_distributed(_old_job, 4, 50, 6, tmp_dir=tmp_path, timeout=120)
    run_distributed(_new_job, 3, 50, str(tmp_path / "ck.pt"), timeout=120)
