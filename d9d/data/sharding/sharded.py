"""A data-parallel rank's slice of a dataset, and its resumable cursor.

The global sample order is defined *before* sharding (shuffle and bucketing are seeded the same on every
rank), so it does not depend on the DP size; this layer only deals that order out to `num_shards` ranks
and remembers how far this rank has read. Being the outermost per-rank layer, it is the one stateful
object a data provider checkpoints.

The state is the *job's* position, not just this rank's: DP ranks consume in lockstep (every step takes
the same number of samples on every rank), so one rank's cursor says how many rounds all of them have
read. Save the state of shard 0 (dp rank 0; in `uneven="keep"` mode it is the longest shard, so its
cursor is the round count even at the end of a pass) and load it on every rank.

Re-sharding (`on_reshard="keep_position"`): when an elastic restart changes the DP size, the samples the
old shards had consumed are removed from the pass's pool and the rest is dealt to the new shards —
nothing is skipped or repeated. In `sequential` mode the remainder is exactly the tail of the global
stream after its saved position.

Uneven passes with `uneven="drop"`: `r = N mod (n·block)` samples sit out each pass so that all shards
have the same length (whole runs of `block`). Over a dataset in a fixed order they are a window that moves
on by its width every pass (pass e leaves out positions [(e-1)·r, e·r) mod N: the tail in pass 0, then the
head, ...), so consecutive passes leave out different samples and every sample is dealt over any two
passes. An `EpochAware` dataset reorders itself each pass, so its own tail sits out: moving the window
inside its order would split the neighbourhoods it builds (length-bucketed packs) for the rest of the
pass. The window is taken out of the pass's pool, so the saved pool already holds it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Generic, Literal, TypeVar

from d9d.data.protocols import EpochAware, SizedDataset, Stateful
from d9d.data.sharding.layout import ShardingMode, ShardLayout, UnevenPolicy
from d9d.data.sharding.ranges import IndexRanges, complement

T = TypeVar("T")

ReshardPolicy = Literal["error", "keep_position"]


class _Snapshot(Generic[T]):
    """The not-yet-read rest of a pass, frozen: safe to hand to DataLoader workers."""

    def __init__(
        self, dataset: SizedDataset[T], pool: IndexRanges, layout: ShardLayout, shard: int, start: int
    ) -> None:
        self._dataset, self._pool, self._layout, self._shard, self._start = (
            dataset,
            pool,
            layout,
            shard,
            start,
        )

    def __len__(self) -> int:
        return self._layout.length(self._shard) - self._start

    def __getitem__(self, index: int) -> T:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} remaining samples")
        return self._dataset[self._pool[self._layout.position(self._shard, self._start + index)]]


class ShardedDataset(Generic[T]):
    """Shard `shard_index` of `num_shards` over `dataset`, for `epochs` passes (None: forever).

    `block` (sequential mode) deals runs of that many consecutive samples to one shard: set it to the
    microbatch size when `dataset` puts samples of similar length side by side (`BufferSortedDataset`
    with `pack_size` = microbatch size), so each shard's microbatch is one pack.

    Read it by iterating (the cursor advances as samples are handed out), or — with DataLoader workers —
    wrap `remaining()` in the DataLoader and call `advance(n)` for the samples actually consumed.
    """

    def __init__(
        self,
        dataset: SizedDataset[T],
        *,
        num_shards: int,
        shard_index: int,
        mode: ShardingMode = "sequential",
        uneven: UnevenPolicy = "keep",
        epochs: int | None = 1,
        on_reshard: ReshardPolicy = "error",
        block: int = 1,
    ) -> None:
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index={shard_index} must be in [0, num_shards={num_shards})")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs={epochs} must be >= 1 or None (repeat forever)")
        if block < 1:
            raise ValueError(f"block={block} must be >= 1")
        if on_reshard not in ("error", "keep_position"):
            raise ValueError(f"on_reshard={on_reshard!r} must be 'error' or 'keep_position'")
        size = len(dataset)
        if size == 0:
            raise ValueError("cannot shard an empty dataset")
        if epochs != 1 and num_shards > 1 and uneven == "keep":
            raise ValueError(
                "uneven='keep' gives shards of different lengths, so with several epochs the ranks would "
                "start the next epoch at different steps; use uneven='pad' or 'drop'"
            )
        if epochs != 1 and uneven == "drop" and size < num_shards * block:
            raise ValueError(
                f"uneven='drop' leaves nothing of {size} samples for {num_shards} shards"
                + (f" taking runs of block={block}" if block > 1 else "")
            )
        self.dataset = dataset
        self.num_shards = num_shards
        self.shard_index = shard_index
        self.mode: ShardingMode = mode
        self.uneven: UnevenPolicy = uneven
        self.epochs = epochs
        self.on_reshard: ReshardPolicy = on_reshard
        self.block = block
        self._start_epoch(0)

    # -- the pass ------------------------------------------------------------------------------------

    def _layout_for(self, pool: IndexRanges) -> ShardLayout:
        return ShardLayout(len(pool), self.num_shards, self.mode, self.uneven, self.block)

    def _pass_pool(self, epoch: int) -> IndexRanges:
        """The samples dealt in pass `epoch`: all of them, less the moving window of `drop` (module doc)."""
        size = len(self.dataset)
        full = IndexRanges.full(size)
        width = size % (self.num_shards * self.block)
        if self.uneven != "drop" or width == 0:
            return full
        moves = 0 if isinstance(self.dataset, EpochAware) else epoch
        start = (size - width + moves * width) % size
        window = [(start, min(start + width, size)), (0, start + width - size)]  # may wrap around
        return full.select(complement(window, size))

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.position = 0
        self._pool = self._pass_pool(epoch)
        self._layout = self._layout_for(self._pool)
        if isinstance(self.dataset, EpochAware):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        """Samples this shard gets in the current pass (read or not)."""
        return self._layout.length(self.shard_index)

    def __getitem__(self, index: int) -> T:
        """The shard's `index`-th sample of the current pass, regardless of the cursor."""
        return self.dataset[self.source_index(index)]

    def source_index(self, index: int) -> int:
        return self._pool[self._layout.position(self.shard_index, index)]

    def _next_epoch(self) -> bool:
        if self.epochs is not None and self.epoch + 1 >= self.epochs:
            return False
        self._start_epoch(self.epoch + 1)
        return True

    def __iter__(self) -> Iterator[T]:
        while True:
            if self.position >= len(self):
                if not self._next_epoch():
                    return
                continue
            index = self.position
            self.position += 1  # counted before handing out: a state taken now excludes this sample
            yield self[index]

    def remaining(self) -> _Snapshot[T]:
        """The rest of the current pass from the cursor (the next pass once this one is read out); empty
        only after the last epoch. Does not move the cursor."""
        while self.position >= len(self) and self._next_epoch():
            pass
        return _Snapshot(self.dataset, self._pool, self._layout, self.shard_index, self.position)

    def advance(self, count: int) -> None:
        """Mark `count` more samples consumed, rolling into the next epoch at the end of a pass."""
        if count < 0:
            raise ValueError(f"cannot advance by {count}")
        while count:
            left = len(self) - self.position
            if count <= left:
                self.position += count
                return
            count -= left
            self.position = len(self)
            if not self._next_epoch():
                raise ValueError(
                    f"advanced past the end of the last epoch ({self.epochs}) by {count} samples"
                )

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "length": len(self.dataset),
            "epoch": self.epoch,
            "position": self.position,
            "pool": self._pool.to_list(),
            "num_shards": self.num_shards,
            "mode": self.mode,
            "uneven": self.uneven,
            "block": self.block,
        }
        if isinstance(self.dataset, Stateful):
            state["dataset"] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["length"] != len(self.dataset):
            raise ValueError(
                f"cannot resume sharded dataset: checkpoint was taken over {state['length']} samples, "
                f"this dataset has {len(self.dataset)}"
            )
        if isinstance(self.dataset, Stateful):
            self.dataset.load_state_dict(state["dataset"])
        saved_pool = IndexRanges.from_list(state["pool"])
        # States from before `block` existed were dealt one sample at a time.
        saved = {**state, "block": int(state.get("block", 1))}
        saved_layout = ShardLayout(
            len(saved_pool), int(saved["num_shards"]), saved["mode"], saved["uneven"], saved["block"]
        )
        self.epoch = int(state["epoch"])
        if isinstance(self.dataset, EpochAware):
            self.dataset.set_epoch(self.epoch)
        if saved_layout == self._layout_for(saved_pool):
            self._pool, self._layout = saved_pool, saved_layout
            self.position = min(int(state["position"]), len(self))  # a shorter shard may be read out already
            return
        changes = ", ".join(
            f"{key}={saved[key]!r}→{getattr(self, key)!r}"
            for key in ("num_shards", "mode", "uneven", "block")
            if saved[key] != getattr(self, key)
        )
        if self.on_reshard == "error":
            raise ValueError(
                f"sharding changed since the checkpoint ({changes}); build the dataset with "
                "on_reshard='keep_position' to re-deal the unread samples of this pass to the new shards"
            )
        # Lockstep: the saved position is the number of rounds every old shard has consumed.
        consumed = saved_layout.consumed(int(state["position"]))
        self._pool = saved_pool.select(complement(consumed, len(saved_pool)))
        self._layout = self._layout_for(self._pool)
        self.position = 0
