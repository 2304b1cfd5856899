"""Padding, packing, pooling masks and the causal-LM collator against loop-based references."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from d9d.data.collate import (
    IGNORE_INDEX,
    CausalLMCollator,
    block_causal_mask,
    pack_sequences,
    pad_stack,
    plan_packs,
    pooling_weights,
)


def _rand_seqs(lengths: list[int], seed: int = 0, rest: tuple[int, ...] = ()) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (n, *rest), generator=g) for n in lengths]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(("multiple", "length"), [(None, None), (8, None), (None, 12)])
def test_pad_stack_against_lists(side: str, multiple: int | None, length: int | None) -> None:
    seqs = _rand_seqs([3, 7, 1, 5], rest=(2,))
    out = pad_stack(seqs, -9, side=side, pad_to_multiple_of=multiple, length=length)
    target = length or (8 if multiple else 7)
    assert out.shape == (4, target, 2)
    for row, seq in zip(out.tolist(), seqs, strict=True):
        pad = [[-9, -9]] * (target - len(seq))
        assert row == (seq.tolist() + pad if side == "right" else pad + seq.tolist())


def test_pad_stack_errors() -> None:
    with pytest.raises(ValueError, match="shorter"):
        pad_stack(_rand_seqs([5]), 0, length=4)
    with pytest.raises(ValueError, match="sequence 1"):
        pad_stack([torch.zeros(3), torch.zeros(3, 2)], 0)
    with pytest.raises(ValueError, match="side"):
        pad_stack(_rand_seqs([2]), 0, side="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        pad_stack(_rand_seqs([2]), 0, pad_to_multiple_of=0)


def test_plan_packs_is_in_order_next_fit() -> None:
    rng = random.Random(1)
    for _ in range(100):
        cap = rng.randint(1, 20)
        lengths = [rng.randint(1, cap) for _ in range(rng.randint(1, 30))]
        rows = plan_packs(lengths, cap)
        assert [i for r in rows for i in r] == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in r) <= cap for r in rows)
        # Next-fit: a row was closed only because the next sequence did not fit.
        for a, b in itertools.pairwise(rows):
            assert sum(lengths[i] for i in a) + lengths[b[0]] > cap
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens"):
        plan_packs([2, 9], 8)


def test_pack_sequences_positions_restart() -> None:
    seqs = _rand_seqs([3, 1, 4])
    values, pos, doc = pack_sequences(seqs)
    assert values.tolist() == list(itertools.chain.from_iterable(s.tolist() for s in seqs))
    assert pos.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert doc.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]


def test_block_causal_mask_against_loops() -> None:
    doc = torch.tensor([[0, 0, 1, 1, 1, -1], [0, 1, 2, 2, -1, -1]])
    mask = block_causal_mask(doc)
    for b in range(2):
        for t in range(6):
            for s in range(6):
                expected = doc[b, t] >= 0 and doc[b, t] == doc[b, s] and s <= t
                assert bool(mask[b, t, s]) == bool(expected)


def test_packed_attention_equals_per_document_attention() -> None:
    torch.manual_seed(0)
    lengths = [3, 5, 2]
    q, k, v = (torch.randn(1, 2, sum(lengths), 4, dtype=torch.float64) for _ in range(3))
    _, _, doc = pack_sequences([torch.zeros(n) for n in lengths])
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(doc[None])[:, None])
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True)
        torch.testing.assert_close(packed[:, :, sl], alone)
        start += n


def _pool_reference(doc: torch.Tensor, kind: str) -> torch.Tensor:
    b, t = doc.shape
    d = int(doc.max()) + 1
    out = torch.zeros(b, d, t)
    for i in range(b):
        for j in range(d):
            where = [s for s in range(t) if doc[i, s] == j]
            if not where:
                continue
            if kind == "mean":
                out[i, j, where] = 1 / len(where)
            else:
                out[i, j, where[0] if kind == "first" else where[-1]] = 1
    return out


@pytest.mark.parametrize("kind", ["mean", "first", "last"])
def test_pooling_weights_against_loops(kind: str) -> None:
    packed = torch.tensor([[0, 0, 1, 1, 1, 2, -1], [0, 0, 0, 0, 1, -1, -1]])
    left_padded = torch.tensor([[-1, -1, 0, 0, 0], [0, 0, 0, 0, 0]])
    for doc in (packed, left_padded):
        torch.testing.assert_close(pooling_weights(doc, kind), _pool_reference(doc, kind))  # type: ignore[arg-type]
    hidden = torch.randn(2, 7, 3)
    pooled = pooling_weights(packed, kind) @ hidden  # type: ignore[arg-type]
    if kind == "last":
        torch.testing.assert_close(pooled[0, 1], hidden[0, 4])


def _samples(lengths: list[int], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": s} for s in _rand_seqs(lengths, seed)]


@pytest.mark.parametrize("side", ["left", "right"])
def test_collator_padded_rows(side: str) -> None:
    samples = _samples([4, 2, 5])
    batch = CausalLMCollator(pad_id=99, side=side, pad_to_multiple_of=4)(samples)
    assert {k: tuple(v.shape) for k, v in batch.items()} == dict.fromkeys(
        ["input_ids", "labels", "position_ids", "attention_mask", "document_ids"], (3, 8)
    )
    for row, sample in enumerate(samples):
        ids = sample["input_ids"].tolist()
        n, pad = len(ids), 8 - len(ids)

        def place(real: list[int], fill: int, n: int = n, pad: int = pad) -> list[int]:
            return real + [fill] * pad if side == "right" else [fill] * pad + real

        assert batch["input_ids"][row].tolist() == place(ids, 99)
        assert batch["labels"][row].tolist() == place([*ids[1:], IGNORE_INDEX], IGNORE_INDEX)
        assert batch["position_ids"][row].tolist() == place(list(range(n)), 0)
        assert batch["attention_mask"][row].tolist() == place([1] * n, 0)
        assert batch["document_ids"][row].tolist() == place([0] * n, -1)


def test_collator_packed_rows() -> None:
    lengths = [3, 4, 2, 6, 1, 5]
    samples = _samples(lengths, seed=2)
    batch = CausalLMCollator(pad_id=0, pack_length=8)(samples)
    rows = plan_packs(lengths, 8)
    assert batch["input_ids"].shape == (len(rows), 8)
    for r, members in enumerate(rows):
        expected_ids: list[int] = []
        expected_labels: list[int] = []
        expected_pos: list[int] = []
        expected_doc: list[int] = []
        for d, i in enumerate(members):
            ids = samples[i]["input_ids"].tolist()
            expected_ids += ids
            expected_labels += [*ids[1:], IGNORE_INDEX]  # never predicts the next document's first token
            expected_pos += list(range(len(ids)))
            expected_doc += [d] * len(ids)
        pad = 8 - len(expected_ids)
        assert batch["input_ids"][r].tolist() == expected_ids + [0] * pad
        assert batch["labels"][r].tolist() == expected_labels + [IGNORE_INDEX] * pad
        assert batch["position_ids"][r].tolist() == expected_pos + [0] * pad
        assert batch["document_ids"][r].tolist() == expected_doc + [-1] * pad


class _TinyCausalLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(60, 8, dtype=torch.float64)
        self.pos = torch.nn.Embedding(16, 8, dtype=torch.float64)
        self.qkv = torch.nn.Linear(8, 24, dtype=torch.float64)
        self.out = torch.nn.Linear(8, 60, dtype=torch.float64)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        h = self.tok(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        return self.out(h + F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_packed_loss_equals_unpacked_loss() -> None:
    torch.manual_seed(0)
    model = _TinyCausalLM()
    samples = _samples([5, 3, 7, 2, 6], seed=4)

    def total_loss(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        mask = block_causal_mask(batch["document_ids"])
        mask = mask | torch.eye(
            mask.shape[-1], dtype=torch.bool
        )  # padding rows attend to themselves (no NaN)
        logits = model(batch["input_ids"], batch["position_ids"], mask)
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        return loss, (batch["labels"] != IGNORE_INDEX).sum()

    padded = total_loss(CausalLMCollator(pad_id=0)(samples))
    packed = total_loss(CausalLMCollator(pad_id=0, pack_length=10)(samples))
    # Reference: each document alone, labels shifted the textbook way.
    ref, count = torch.zeros((), dtype=torch.float64), 0
    for s in samples:
        ids = s["input_ids"][None]
        pos = torch.arange(ids.shape[1])[None]
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
        logits = model(ids, pos, causal)
        ref = ref + F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        count += ids.shape[1] - 1
    torch.testing.assert_close(padded[0], ref)
    torch.testing.assert_close(packed[0], ref)
    assert int(padded[1]) == int(packed[1]) == count


def test_collator_errors() -> None:
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        CausalLMCollator(pad_id=0, pack_length=8, pad_to_multiple_of=4)
    with pytest.raises(ValueError, match="sequence 0 has 9 tokens"):
        CausalLMCollator(pad_id=0, pack_length=8)(_samples([9]))
    with pytest.raises(KeyError, match="sample 1 has no 'input_ids'"):
        CausalLMCollator(pad_id=0)([{"input_ids": torch.ones(2, dtype=torch.long)}, {"ids": torch.ones(2)}])
    with pytest.raises(ValueError, match="empty"):
        CausalLMCollator(pad_id=0)([])


@pytest.mark.parametrize("pack_length", [None, 8])
def test_right_side_means_padding_only_trails_real_tokens(pack_length: int | None) -> None:
    """What `padding_side=collator.side` declares to the model: with the default side every row is real
    tokens then padding, never padding before a real token (padded rows and packed rows alike)."""
    collator = CausalLMCollator(pad_id=0, pack_length=pack_length)
    assert collator.side == "right"
    batch = collator(_samples([3, 4, 2, 6, 1, 5], seed=5))
    mask = batch["attention_mask"]
    assert bool((mask == 0).any())  # the property is exercised, not vacuous
    assert bool((mask[:, 1:] <= mask[:, :-1]).all())
    assert bool(((batch["document_ids"] < 0) == (mask == 0)).all())
