"""Built-in data provider: text or jsonl files, tokenized (byte-level or HF tokenizer.json), optionally
length-bucketed, dealt to data-parallel ranks from one global order, collated for causal LM.

The resumable state is the sharded dataset's position in that global order, so a restart with a different
DP degree continues with the next unread sample (no sample skipped or repeated).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from d9d.core.types import PyTree
from d9d.data import (
    BufferSortedDataset,
    CausalLMCollator,
    ShardedDataset,
    TextDatasetConfig,
    build_text_dataset,
)
from d9d.engine.providers import DataSetup


class TextDataProvider:
    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

        dataset: TextDatasetConfig
        # Length bucketing: sort within a shuffling buffer of this many samples (None: file order).
        bucketing_buffer: int | None = Field(None, ge=1)
        pad_to_multiple_of: int = Field(8, ge=1)
        # Passes over the data (None: repeat until training ends).
        epochs: int | None = Field(None, ge=1)

    def __init__(self, config: Config) -> None:
        self.config = config
        self._stream: _Stream | None = None

    @property
    def stream(self) -> _Stream:
        if self._stream is None:
            raise RuntimeError("TextDataProvider.setup() must run first")
        return self._stream

    def setup(self, setup: DataSetup) -> None:
        c = self.config
        dataset: Any = build_text_dataset(c.dataset)
        pad_id = dataset.tokenizer.pad_id
        if pad_id is None:
            raise ValueError("data.options.dataset.tokenizer has no padding token; the collator needs one")
        if c.bucketing_buffer is not None:
            dataset = BufferSortedDataset(
                dataset, buffer_size=c.bucketing_buffer, pack_size=setup.microbatch_size, seed=setup.seed
            )
        sharded = ShardedDataset(
            dataset,
            num_shards=setup.dp_size,
            shard_index=setup.dp_rank,
            uneven="keep" if c.epochs == 1 else "drop",
            epochs=c.epochs,
            on_reshard="keep_position",
        )
        collate = CausalLMCollator(pad_id=pad_id, pad_to_multiple_of=c.pad_to_multiple_of)
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
