from __future__ import annotations

import pytest
import torch

from d9d.core import tree_cat, tree_map_tensors, tree_shard, tree_split


def _batch() -> dict[str, object]:
    return {
        "input_ids": torch.arange(24).reshape(6, 4),
        "extra": {"mask": torch.ones(6, 4, dtype=torch.bool), "weights": [torch.arange(6.0)]},
        "name": "batch",
        "scale": 2,
    }


def test_split_then_cat_is_identity() -> None:
    batch = _batch()
    pieces = tree_split(batch, 3)
    assert len(pieces) == 3
    assert torch.equal(pieces[1]["input_ids"], batch["input_ids"][2:4])  # type: ignore[index]
    assert torch.equal(pieces[2]["extra"]["weights"][0], torch.tensor([4.0, 5.0]))  # type: ignore[index]
    assert all(p["name"] == "batch" and p["scale"] == 2 for p in pieces)
    merged = tree_cat(pieces)
    assert torch.equal(merged["input_ids"], batch["input_ids"])  # type: ignore[index]
    assert torch.equal(merged["extra"]["mask"], batch["extra"]["mask"])  # type: ignore[index]


def test_split_along_other_dim() -> None:
    t = {"x": torch.arange(12).reshape(2, 6)}
    pieces = tree_split(t, 2, dim=1)
    assert torch.equal(pieces[0]["x"], torch.tensor([[0, 1, 2], [6, 7, 8]]))


def test_shard_picks_contiguous_chunk() -> None:
    shard = tree_shard(_batch(), num_shards=2, shard_index=1)
    assert torch.equal(shard["input_ids"], torch.arange(12, 24).reshape(3, 4))
    with pytest.raises(ValueError, match="shard_index 2"):
        tree_shard(_batch(), num_shards=2, shard_index=2)


def test_uneven_split_is_refused_unless_asked() -> None:
    with pytest.raises(ValueError, match="evenly"):
        tree_split(_batch(), 4)
    pieces = tree_split(_batch(), 4, even=False)
    assert [p["input_ids"].shape[0] for p in pieces] == [2, 2, 1, 1]


def test_inconsistent_leaves_are_refused() -> None:
    with pytest.raises(ValueError, match="disagree"):
        tree_split({"a": torch.zeros(4), "b": torch.zeros(6)}, 2)
    with pytest.raises(ValueError, match="different structure"):
        tree_cat([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])


def test_map_tensors_leaves_other_leaves() -> None:
    out = tree_map_tensors(lambda t: t * 0, _batch())
    assert out["name"] == "batch"
    assert int(out["input_ids"].sum()) == 0
