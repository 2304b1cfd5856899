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


# -- `drop` over several passes: the samples that sit out move each pass ----------------------------------


def _pass_order(n_items: int, n: int, epoch: int) -> list[int]:
    """Reference: pass `epoch` of a fixed-order dataset at n shards leaves out n_items mod n samples, a
    window that starts at the tail in pass 0 and moves on by its width each pass (wrapping)."""
    width = n_items % n
    start = (n_items - width + epoch * width) % n_items
    left_out = {(start + j) % n_items for j in range(width)}
    return [i for i in range(n_items) if i not in left_out]


def _deal(order: list[int], n: int) -> list[list[int]]:
    """Reference: sequential dealing, dropping the tail that does not fill a round."""
    usable = order[: len(order) - len(order) % n]
    return [usable[r::n] for r in range(n)]


@pytest.mark.parametrize(("n_items", "n"), [(23, 2), (23, 3), (10, 3), (5, 3), (16, 5)])
def test_drop_moves_the_left_out_samples_so_every_sample_is_dealt(n_items: int, n: int) -> None:
    passes = 4
    got = [list(s) for s in _shards(n_items, n, "sequential", "drop", epochs=passes)]
    per_pass = n_items // n
    want = [[] for _ in range(n)]  # type: list[list[int]]
    for epoch in range(passes):
        for r, part in enumerate(_deal(_pass_order(n_items, n, epoch), n)):
            want[r] += part
    assert got == want
    for epoch in range(passes):
        dealt = [x for g in got for x in g[epoch * per_pass : (epoch + 1) * per_pass]]
        assert len(set(dealt)) == len(dealt) == n * per_pass  # no repeats inside a pass
    # Any two consecutive passes together deal every sample (a fixed tail would never be dealt).
    for epoch in range(passes - 1):
        two = {x for g in got for x in g[epoch * per_pass : (epoch + 2) * per_pass]}
        assert two == set(range(n_items))


def _lockstep_read(shards: list[ShardedDataset[int]], rounds: int | None) -> list[list[int]]:
    """Each shard's next `rounds` samples (None: to the end), read one round at a time."""
    its = [iter(s) for s in shards]
    out: list[list[int]] = [[] for _ in shards]
    for _ in itertools.count() if rounds is None else range(rounds):
        step = [list(itertools.islice(it, 1)) for it in its]
        if not any(step):
            break
        for mine, got in zip(out, step, strict=True):
            mine += got
    return out


@pytest.mark.parametrize(("old_n", "new_n"), [(2, 3), (3, 2), (3, 3)])
@pytest.mark.parametrize("rounds", [4, 7, 11, 14, 15, 20])  # passes of 11 (2 shards), 7 (3)
def test_drop_resume_at_another_dp_mid_pass_and_across_a_pass_boundary(
    old_n: int, new_n: int, rounds: int
) -> None:
    n_items, passes = 23, 3
    old = _shards(n_items, old_n, "sequential", "drop", epochs=passes)
    before = _lockstep_read(old, rounds)
    state = _roundtrip(old[0].state_dict())
    new = _shards(n_items, new_n, "sequential", "drop", epochs=passes, on_reshard="keep_position")
    for s in new:
        s.load_state_dict(state)
    after = _lockstep_read(new, None)
    # Reference: the old job's global stream up to the switch, the rest of that pass dealt to the new
    # shards (its last len mod new_n samples sit out), then whole passes at the new shard count.
    # A pass the old job had not started is laid out for the new shard count.
    epoch, done = divmod(rounds, n_items // old_n)
    stream = _pass_order(n_items, old_n if done else new_n, epoch)
    assert sorted(x for g in before for x in g) == sorted(
        [x for e in range(epoch) for x in _pass_order(n_items, old_n, e)] + stream[: done * old_n]
    )
    want = _deal(stream[done * old_n :], new_n)
    for e in range(epoch + 1, passes):
        want = [w + part for w, part in zip(want, _deal(_pass_order(n_items, new_n, e), new_n), strict=True)]
    assert after == want
    uninterrupted = _lockstep_read(_shards(n_items, new_n, "sequential", "drop", epochs=passes), None)
    if old_n == new_n:
        assert after == [u[rounds:] for u in uninterrupted]
    elif done == 0:
        # At a pass boundary the new job continues exactly as a job that ran at new_n all along.
        skip = epoch * (n_items // new_n)
        assert after == [u[skip:] for u in uninterrupted]


def test_drop_state_from_before_the_moving_window_finishes_its_pass_as_saved() -> None:
    # What a state of the previous version looked like mid-pass 1: the full pool (the tail left out by the
    # layout) and no `block` key. It finishes that pass as it would have, then passes move the window.
    n_items, n = 23, 3
    old_state = {
        "length": n_items,
        "epoch": 1,
        "position": 2,
        "pool": [[0, n_items]],
        "num_shards": n,
        "mode": "sequential",
        "uneven": "drop",
    }
    shards = _shards(n_items, n, "sequential", "drop", epochs=3)
    for s in shards:
        s.load_state_dict(old_state)
    got = _lockstep_read(shards, None)
    rest_of_pass = [list(range(n_items - n_items % n))[r::n][2:] for r in range(n)]
    last_pass = _deal(_pass_order(n_items, n, 2), n)
    assert got == [a + b for a, b in zip(rest_of_pass, last_pass, strict=True)]


def test_drop_keeps_the_tail_of_an_epoch_aware_dataset() -> None:
    """A dataset that reorders itself each pass leaves out its own tail (so its neighbourhoods stay)."""

    class Reversing:
        def __init__(self) -> None:
            self.epoch = 0

        def __len__(self) -> int:
            return 11

        def __getitem__(self, index: int) -> int:
            return 10 - index if self.epoch % 2 else index

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    shards = [
        ShardedDataset(Reversing(), num_shards=2, shard_index=r, uneven="drop", epochs=2) for r in range(2)
    ]
    got = _lockstep_read(shards, None)
    assert got == [
        list(range(0, 10, 2)) + list(range(10, 0, -2)),
        list(range(1, 10, 2)) + list(range(9, 0, -2)),
    ]


# -- `block`: runs of consecutive samples stay on one shard ----------------------------------------------


def _reference_blocks(n_items: int, n: int, block: int, uneven: str) -> list[list[int]]:
    """Runs of `block` dealt round-robin; the last, partial round split evenly (`pad`: a short shard repeats
    pool position shard - (n_items mod n)), or left out (`drop`)."""
    full = n_items // (n * block)
    shards = [[(k * n + r) * block + j for k in range(full) for j in range(block)] for r in range(n)]
    tail = [] if uneven == "drop" else list(range(full * n * block, n_items))
    for r, part in enumerate(np.array_split(np.asarray(tail, dtype=int), n)):
        shards[r] += part.tolist()
    if uneven == "pad":
        longest = max(map(len, shards))
        for r, s in enumerate(shards):
            if len(s) < longest:
                s.append((r - n_items % n) % n_items)
    return shards


@pytest.mark.parametrize("uneven", ["keep", "pad", "drop"])
@pytest.mark.parametrize(
    ("n_items", "n", "block"), [(29, 2, 4), (29, 3, 4), (40, 4, 5), (7, 3, 2), (13, 1, 4)]
)
def test_blocks_deal_runs_of_consecutive_samples(n_items: int, n: int, block: int, uneven: str) -> None:
    got = [list(s) for s in _shards(n_items, n, "sequential", uneven, block=block)]
    assert got == _reference_blocks(n_items, n, block, uneven)
    if uneven == "keep":
        assert sorted(itertools.chain(*got)) == list(range(n_items))


@pytest.mark.parametrize(("old_n", "new_n"), [(4, 2), (2, 3), (3, 1), (1, 4)])
@pytest.mark.parametrize("rounds", [0, 3, 4, 7, 8])
def test_blocks_reshard_keeps_position(old_n: int, new_n: int, rounds: int) -> None:
    n_items, block = 61, 4
    old = _shards(n_items, old_n, "sequential", "keep", block=block)
    before = _lockstep_consume(old, rounds)
    new = _shards(n_items, new_n, "sequential", "keep", block=block, on_reshard="keep_position")
    for s in new:
        s.load_state_dict(_roundtrip(old[0].state_dict()))
    after = [list(s) for s in new]
    assert sorted(before + list(itertools.chain(*after))) == list(range(n_items))
    if rounds % block == 0:
        # Whole runs read: the stream continues after a prefix, dealt in runs to the new shards.
        consumed = min(rounds * old_n, n_items)
        assert sorted(before) == list(range(consumed))
        tail = _reference_blocks(n_items - consumed, new_n, block, "keep")
        assert after == [[consumed + x for x in t] for t in tail]


def test_block_needs_sequential_mode() -> None:
    with pytest.raises(ValueError, match="block=2 needs mode='sequential'"):
        ShardedDataset(list(range(8)), num_shards=2, shard_index=0, mode="chunked", block=2)
    with pytest.raises(ValueError, match="block=0"):
        ShardedDataset(list(range(8)), num_shards=2, shard_index=0, block=0)


def test_a_state_from_before_block_is_one_sample_runs() -> None:
    old = _shards(20, 2, "sequential", "keep")[0]
    _consume(old, 3)
    state = old.state_dict()
    del state["block"]  # what the previous version saved
    same = ShardedDataset(list(range(20)), num_shards=2, shard_index=0)
    same.load_state_dict(state)
    assert list(same) == list(old)
    with pytest.raises(ValueError, match=r"block=1→4.*keep_position"):
        ShardedDataset(list(range(20)), num_shards=2, shard_index=0, block=4).load_state_dict(state)
