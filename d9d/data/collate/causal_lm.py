"""Batches for causal language modelling, padded or packed.

`labels` are next-token targets already aligned with the inputs: `labels[t]` is the token that should
follow `input_ids[t]` within the same document, and -100 (ignored by cross-entropy) on padding and on each
document's last token. The loss is therefore a plain `cross_entropy(logits.flatten(0, 1), labels.flatten())`
— no shift in the model or the loss, so a pipeline's last stage needs nothing but its own logits, and
packed documents never predict across a boundary. (Hugging Face models shift internally; to compare with
one, pass these labels as `shift_labels`.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from d9d.data.collate.packing import pack_sequences, plan_packs
from d9d.data.collate.padding import PadSide, pad_stack

IGNORE_INDEX = -100


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets for one document: its tokens shifted left by one, the last target ignored."""
    return torch.cat([input_ids[1:], input_ids.new_full((1,), IGNORE_INDEX)])


@dataclass(frozen=True)
class CausalLMCollator:
    """Samples `{key: 1-D LongTensor}` → `input_ids, labels, position_ids, attention_mask, document_ids`,
    all `(B, T)` long.

    - `pack_length=None`: one sample per row, `T` = longest sample rounded up to `pad_to_multiple_of`.
    - `pack_length=L`: samples are packed in order into rows of exactly `L` tokens (fixed shapes); the row
      count varies with the sample lengths. A sample longer than `L` is an error — truncate upstream
      (`max_length` of the dataset) so no tokens are dropped silently.

    `document_ids` numbers the documents of a row from 0 (-1 on padding); `position_ids` restart at 0 for
    each document. Packed rows also carry `segment_ids` (the same numbers), the key the models read to keep
    attention inside each document.

    With `side="right"` (the default) padding only ever trails a row's real tokens. Pass
    `padding_side=collator.side` to the model with `attention_mask`: a causal model then needs no key mask
    (no real query can see a key after it, and labels ignore padded positions), so the batch keeps the plain
    causal attention kernel instead of a masked one — and the model knows it without inspecting the mask
    (a host sync per step).
    """

    pad_id: int
    pack_length: int | None = None
    pad_to_multiple_of: int | None = None
    side: PadSide = "right"
    key: str = "input_ids"

    def __post_init__(self) -> None:
        if self.pack_length is not None and self.pack_length < 1:
            raise ValueError(f"pack_length={self.pack_length} must be >= 1")
        if self.pack_length is not None and self.pad_to_multiple_of is not None:
            raise ValueError("pack_length fixes the row length; pad_to_multiple_of must be None with it")

    def _sequences(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty list of samples")
        out = []
        for i, sample in enumerate(samples):
            if self.key not in sample:
                raise KeyError(f"sample {i} has no {self.key!r} (keys: {sorted(sample)})")
            seq = sample[self.key]
            if seq.dim() != 1 or len(seq) == 0:
                raise ValueError(
                    f"sample {i}: {self.key!r} must be a non-empty 1-D tensor, got {tuple(seq.shape)}"
                )
            out.append(seq.long())
        return out

    def __call__(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        sequences = self._sequences(samples)
        if self.pack_length is None:
            groups = [[i] for i in range(len(sequences))]
        else:
            groups = plan_packs([len(s) for s in sequences], self.pack_length)
        rows_ids, rows_pos, rows_doc, rows_lab = [], [], [], []
        for group in groups:
            docs = [sequences[i] for i in group]
            ids, pos, doc = pack_sequences(docs)
            rows_ids.append(ids)
            rows_pos.append(pos)
            rows_doc.append(doc)
            rows_lab.append(torch.cat([next_token_labels(d) for d in docs]))

        def stack(rows: list[torch.Tensor], value: int) -> torch.Tensor:
            return pad_stack(
                rows,
                value,
                side=self.side,
                pad_to_multiple_of=self.pad_to_multiple_of,
                length=self.pack_length,
            )

        document_ids = stack(rows_doc, -1)
        batch = {
            "input_ids": stack(rows_ids, self.pad_id),
            "labels": stack(rows_lab, IGNORE_INDEX),
            "position_ids": stack(rows_pos, 0),
            "attention_mask": (document_ids >= 0).long(),
            "document_ids": document_ids,
        }
        if self.pack_length is not None:
            # what the model confines attention with; only for packed rows, so that one-document rows keep
            # the plain causal kernel
            batch["segment_ids"] = document_ids
        return batch
