"""Built-in data provider: text or jsonl files or a Hugging Face dataset, tokenized (byte-level or HF
tokenizer.json), optionally length-bucketed, dealt to data-parallel ranks from one global order (with
bucketing, whole packs of one microbatch per rank), collated for causal LM — one document per row, or packed
into rows of `pack_length` tokens.

The resumable state is the sharded dataset's position in that global order, so a restart with a different
DP degree continues with the next unread sample (no sample skipped or repeated).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from d9d.core.types import PyTree
from d9d.data import (
    BufferSortedDataset,
    CausalLMCollator,
    DatasetConfig,
    ShardedDataset,
    build_dataset,
    build_tokenizer,
    check_dataset,
)
from d9d.engine.providers import DataSetup

_NO_PAD = "dataset.tokenizer has no padding token (set pad_token); the collator needs one"


class TextDataProvider:
    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

        dataset: DatasetConfig
        # Length bucketing: sort within a shuffling buffer of this many samples (None: file order).
        bucketing_buffer: int | None = Field(None, ge=1)
        pad_to_multiple_of: int = Field(8, ge=1)
        # Packing: a microbatch's documents are laid end to end into rows of exactly this many tokens
        # (`segment_ids` keep attention inside each document); None: one padded document per row.
        pack_length: int | None = Field(None, ge=2)
        # Passes over the data (None: repeat until training ends).
        epochs: int | None = Field(None, ge=1)

        @model_validator(mode="after")
        def _check(self) -> Self:
            if self.pack_length is not None:
                max_length = self.dataset.max_length
                if max_length is None or max_length > self.pack_length:
                    raise ValueError(
                        f"pack_length={self.pack_length} needs dataset.max_length <= {self.pack_length} "
                        f"(is {max_length}): a longer document would not fit a row"
                    )
            if self.bucketing_buffer is not None and self.dataset.source == "hf" and self.dataset.streaming:
                raise ValueError(
                    "bucketing_buffer shuffles, which needs random access; a streamed dataset "
                    "(dataset.streaming=true) is read in order"
                )
            return self

    def __init__(self, config: Config) -> None:
        self.config = config
        self._stream: _Stream | None = None

    def validate(self) -> None:
        """What a preflight calls before any rank starts: the dataset's paths, split, column and tokenizer
        (`d9d.data.check_dataset`; nothing is indexed or tokenized), and the padding token the collator
        needs."""
        check_dataset(self.config.dataset)
        if build_tokenizer(self.config.dataset.tokenizer).pad_id is None:
            raise ValueError(_NO_PAD)

    @property
    def stream(self) -> _Stream:
        if self._stream is None:
            raise RuntimeError("TextDataProvider.setup() must run first")
        return self._stream

    def setup(self, setup: DataSetup) -> None:
        c = self.config
        dataset: Any = build_dataset(c.dataset)
        pad_id = dataset.tokenizer.pad_id
        if pad_id is None:
            raise ValueError(_NO_PAD)
        block = 1
        if c.bucketing_buffer is not None:
            # Packs of one microbatch, dealt whole (`block`): each rank's microbatch is one pack of similar
            # lengths, and the global order stays independent of the DP size, so a DP change resumes exactly.
            dataset = BufferSortedDataset(
                dataset, buffer_size=c.bucketing_buffer, pack_size=setup.microbatch_size, seed=setup.seed
            )
            block = setup.microbatch_size
        sharded = ShardedDataset(
            dataset,
            num_shards=setup.dp_size,
            shard_index=setup.dp_rank,
            uneven="keep" if c.epochs == 1 else "drop",
            epochs=c.epochs,
            on_reshard="keep_position",
            block=block,
        )
        collate = CausalLMCollator(
            pad_id=pad_id,
            pack_length=c.pack_length,
            pad_to_multiple_of=None if c.pack_length is not None else c.pad_to_multiple_of,
        )
        self._stream = _Stream(setup, sharded, collate, iter(sharded))

    def next_step(self) -> list[PyTree]:
        """Up to a full step of microbatches; fewer (or none) once a finite dataset runs out."""
        stream = self.stream
        s = stream.setup
        wanted = s.microbatch_size * s.gradient_accumulation
        samples = []
        for _ in range(wanted):
            try:
                samples.append(next(stream.iterator))
            except StopIteration:
                break
        return [
            self._collate(samples[i : i + s.microbatch_size])
            for i in range(0, len(samples), s.microbatch_size)
        ]

    def _collate(self, samples: list[Any]) -> dict[str, Any]:
        batch = self.stream.collate(samples)
        out: dict[str, Any] = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
        if "segment_ids" in batch:
            out["segment_ids"] = batch["segment_ids"]
        if bool((batch["attention_mask"] == 0).any()):  # a host tensor: no device sync
            out["attention_mask"] = batch["attention_mask"]  # only when padded: all-ones would cost speed
            out["padding_side"] = self.stream.collate.side
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.stream.sharded.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        stream = self.stream
        stream.sharded.load_state_dict(state)
        stream.iterator = iter(stream.sharded)


@dataclass
class _Stream:
    """What `setup` builds: this rank's shard of the global sample order and its collator."""

    setup: DataSetup
    sharded: ShardedDataset[Any]
    collate: CausalLMCollator
    iterator: Iterator[Any]
