"""Which keys each query may see: causal order, padding, packed-document segments, sliding windows."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

PaddingSide = Literal["left", "right"]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ShardedQueries:
    """Context parallelism's view: this rank's queries are a subset of the sequence, its keys all of it.

    - `query_index` [q_len] int64: the global position of each local query (the same for every row, since
      every row of a batch is split the same way).
    - `segment_ids` / `padding` [batch, key_len]: the whole sequence's documents and padding, which the
      keys need; the `AttentionMask`'s own `padding` stays the local one (MoE balancing reads it per token).
    """

    query_index: torch.Tensor
    key_len: int
    segment_ids: torch.Tensor | None = None
    padding: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionMask:
    """A causal attention pattern for one batch, kept structured so each backend materializes what it needs.

    Every query may always see itself, so rows of padding tokens stay finite (their outputs are meaningless
    but never NaN, so gradients stay clean).

    - `padding` [batch, seq] bool/int: False (0) marks padding tokens.
    - `padding_side`: `"right"` declares that padding only ever trails a row's real tokens, which is what
      the causal-LM collator produces. Under a causal pattern no real query can reach a key after it, so
      the key mask changes nothing at real positions and is dropped: the batch takes the plain causal
      kernel. The declaration replaces a data-dependent check, which would be a host sync per step.
      `None` (or `"left"`): padding may be anywhere and keys are masked.
    - `segment_ids` [batch, seq] int: tokens only see tokens of the same segment (packed documents).
    - `sharded`: set by context parallelism (`d9d.parallel.context`): queries are this rank's shard, keys
      the whole sequence, and segments/padding are read from the whole-sequence tensors it carries. Never
      plain causal: the local query order is not the key order.
    - `dense_masks` / `block_masks`: per-window materializations built once per forward by the backend's
      `prepare` (outside any compiled region) and only read by the layers, so every layer of a compiled
      stage sees the same structure and no layer mutates shared state.
    """

    padding: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    padding_side: PaddingSide | None = None
    dense_masks: Mapping[int | None, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    block_masks: Mapping[int | None, BlockMask] = field(default_factory=dict, repr=False, compare=False)
    sharded: ShardedQueries | None = None

    @property
    def key_padding(self) -> torch.Tensor | None:
        """The padding that must mask keys: none when the padding is declared to be on the right."""
        if self.padding_side == "right":
            return None
        return self.sharded.padding if self.sharded is not None else self.padding

    @property
    def key_segment_ids(self) -> torch.Tensor | None:
        """Segment ids over the keys (the whole sequence under context parallelism)."""
        return self.sharded.segment_ids if self.sharded is not None else self.segment_ids

    @property
    def is_plain_causal(self) -> bool:
        return self.sharded is None and self.key_padding is None and self.segment_ids is None

    def _positions(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """Global positions of the queries, and the number of keys."""
        if self.sharded is not None:
            return self.sharded.query_index.to(device), self.sharded.key_len
        return torch.arange(seq_len, device=device), seq_len

    def needs_mask(self, window: int | None) -> bool:
        """Whether a layer with this window needs more than the plain causal kernel."""
        return window is not None or not self.is_plain_causal

    def dense(self, seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
        """Boolean mask [batch or 1, 1, q_len, key_len], True where attention is allowed (prepared or built
        now)."""
        prepared = self.dense_masks.get(window)
        if prepared is not None:
            return prepared
        positions, key_len = self._positions(seq_len, device)
        q = positions[:, None]
        k = torch.arange(key_len, device=device)[None, :]
        allowed = k <= q
        if window is not None:
            allowed = allowed & (k > q - window)
        allowed = allowed[None]
        segments = self.key_segment_ids
        if segments is not None:
            allowed = allowed & (segments[:, positions, None] == segments[:, None, :])
        padding = self.key_padding
        if padding is not None:
            allowed = allowed & padding.bool()[:, None, :]
        return (allowed | (q == k)[None])[:, None]

    def mask_mod(self, window: int | None) -> MaskMod:
        """The same pattern as `dense`, as a FlexAttention `mask_mod(batch, head, q_idx, kv_idx)`."""
        segments = self.key_segment_ids
        padding = self.key_padding
        keys = padding.bool() if padding is not None else None
        query_index = self.sharded.query_index if self.sharded is not None else None

        def allowed(
            b: torch.Tensor, h: torch.Tensor, q_local: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            q = query_index[q_local] if query_index is not None else q_local
            ok = kv <= q
            if window is not None:
                ok = ok & (kv > q - window)
            if segments is not None:
                ok = ok & (segments[b, q] == segments[b, kv])
            if keys is not None:
                ok = ok & keys[b, kv]
            return ok | (q == kv)

        return allowed

    def block(self, seq_len: int, window: int | None, device: torch.device) -> BlockMask:
        """FlexAttention block mask for this window (prepared, or built now)."""
        prepared = self.block_masks.get(window)
        if prepared is not None:
            return prepared
        # Without per-row data the pattern is the same for every row: one broadcast row of blocks.
        batch = None
        for rows in (self.key_segment_ids, self.key_padding):
            if rows is not None:
                batch = rows.shape[0]
        key_len = self.sharded.key_len if self.sharded is not None else seq_len
        return create_block_mask(self.mask_mod(window), batch, None, seq_len, key_len, device=device)


def segment_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment ids for packed sequences whose positions restart: a new segment starts wherever the position
    does not follow its predecessor by one (the convention Hugging Face uses to detect packing)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] - position_ids[..., :-1] != 1
    return starts.long().cumsum(-1)
