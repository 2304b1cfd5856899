"""Which keys each query may see: causal order, padding, packed-document segments, sliding windows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMask:
    """A causal attention pattern for one batch, kept structured so each backend materializes what it needs.

    Built once per forward by the model and shared by all layers; dense masks are cached per window size
    because layers with the same window reuse them. Every query may always see itself, so rows of padding
    tokens stay finite (their outputs are meaningless but never NaN, so gradients stay clean).

    - `padding` [batch, seq] bool: False marks padding keys.
    - `segment_ids` [batch, seq] int: tokens only see tokens of the same segment (packed documents).
    """

    padding: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    _dense: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_plain_causal(self) -> bool:
        return self.padding is None and self.segment_ids is None

    def dense(self, seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
        """Boolean mask [batch or 1, 1, seq, seq], True where attention is allowed."""
        cached = self._dense.get(window)
        if cached is not None:
            return cached
        q = torch.arange(seq_len, device=device)[:, None]
        k = torch.arange(seq_len, device=device)[None, :]
        allowed = k <= q
        if window is not None:
            allowed = allowed & (k > q - window)
        allowed = allowed[None]
        if self.segment_ids is not None:
            allowed = allowed & (self.segment_ids[:, :, None] == self.segment_ids[:, None, :])
        if self.padding is not None:
            allowed = allowed & self.padding.bool()[:, None, :]
        allowed = (allowed | (q == k)[None])[:, None]
        self._dense[window] = allowed
        return allowed


def segment_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment ids for packed sequences whose positions restart: a new segment starts wherever the position
    does not follow its predecessor by one (the convention Hugging Face uses to detect packing)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] - position_ids[..., :-1] != 1
    return starts.long().cumsum(-1)
