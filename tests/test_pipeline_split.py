"""Pipeline stage splits (`d9d.pipeline.split`): optimal against brute force, `even` as the old split, the
families' cost models, the provider building each stage with its layers, and errors naming the setting."""

from __future__ import annotations

import itertools
import random

import pytest

from d9d.engine.builtin.models import CausalLMProvider, family_provider
from d9d.models.family import get_family
from d9d.models.qwen3.config import Qwen3Config
from d9d.models.qwen3.family import stage_costs
from d9d.pipeline.api import PipelineStageInfo, balance_layers
from d9d.pipeline.partition import StageCosts, split_layers
from d9d.pipeline.split import EvenSplit, FlopsSplit, LayersSplit, build_stage_split


def _stage_costs(costs: StageCosts, counts: tuple[int, ...]) -> list[float]:
    out, start = [], 0
    for s, c in enumerate(counts):
        own = (costs.first if s == 0 else 0) + (costs.last if s == len(counts) - 1 else 0)
        out.append(own + sum(costs.layers[start : start + c]))
        start += c
    return out


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write `total` as `parts` positive integers, in order."""
    return [
        tuple(b - a for a, b in zip((0, *cuts), (*cuts, total), strict=True))
        for cuts in itertools.combinations(range(1, total), parts - 1)
    ]


def test_split_is_the_best_by_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        layers = rng.randint(1, 9)
        stages = rng.randint(1, min(layers, 4))
        costs = StageCosts(
            rng.choice([0.0, rng.uniform(0, 3)]),
            tuple(rng.choice([1.0, rng.uniform(0.2, 3)]) for _ in range(layers)),
            rng.uniform(0, 12),
        )
        counts = split_layers(costs, stages)
        assert len(counts) == stages and sum(counts) == layers and min(counts) >= 1
        every = {c: _stage_costs(costs, c) for c in _compositions(layers, stages)}
        least_max = min(max(v) for v in every.values())
        got = _stage_costs(costs, counts)
        assert max(got) <= least_max * (1 + 1e-9), (costs, counts)
        least_squares = min(sum(x * x for x in v) for v in every.values() if max(v) <= least_max * (1 + 1e-9))
        assert sum(x * x for x in got) <= least_squares * (1 + 1e-9), (costs, counts)


def _split_before(layers: int, stages: int) -> tuple[int, ...] | None:
    """d9d's even split before session 28 (its own arithmetic, kept here as the reference): the embedding and
    the head one virtual layer each, the total cut into equal parts with the extra ones last; None where a
    stage would have held no layer (that version refused those)."""
    base, extra = divmod(layers + 2, stages)
    sizes = [base + (1 if i >= stages - extra else 0) for i in range(stages)]
    starts = list(itertools.accumulate((0, *sizes)))
    counts = tuple(
        min(max(starts[i + 1] - 1, 0), layers) - min(max(starts[i] - 1, 0), layers) for i in range(stages)
    )
    return counts if min(counts) >= 1 else None


def test_even_is_the_split_of_before() -> None:
    """Unit costs reproduce the even split of earlier versions (the layers their runs held) wherever that
    split exists, the extra layers on the last stages; `balance_layers` without counts is that split."""
    compared = 0
    for stages in range(1, 13):
        for layers in range(stages, 50):
            before = _split_before(layers, stages)
            if before is None:
                continue
            assert split_layers(StageCosts.uniform(layers), stages) == before, (layers, stages)
            held = tuple(len(balance_layers(layers, PipelineStageInfo(s, stages))) for s in range(stages))
            assert held == before, (layers, stages)
            compared += 1
    assert compared > 400
    assert split_layers(StageCosts.uniform(28), 4) == (6, 7, 8, 7)  # stage costs 7, 7, 8, 8


_QWEN3_06B = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "head_dim": 128,
    "num_layers": 28,
    "num_kv_heads": 8,
    "intermediate_size": 3072,
}


def test_flops_split_gives_the_head_its_share() -> None:
    """Qwen3-0.6B's head costs as many FLOPs as ~7 of its layers at 2,048 tokens: the last stage holds that
    many fewer layers, and no stage costs more than the mean plus one layer."""
    costs = stage_costs(Qwen3Config.model_validate(_QWEN3_06B), 2048)
    layer = costs.layers[0]
    assert 7 < costs.last / layer < 8.5
    for stages in (2, 4):
        counts = split_layers(costs, stages)
        per_stage = _stage_costs(costs, counts)
        assert max(per_stage) <= costs.total / stages + layer, counts
    assert split_layers(costs, 2) == (18, 10)
    # by FLOPs the even split's last stage costs ~1.4x its first
    even = _stage_costs(costs, split_layers(StageCosts.uniform(28), 2))
    assert even[1] / even[0] > 1.4


def _provider(split: dict[str, object] | None = None) -> CausalLMProvider:
    architecture = {**_QWEN3_06B, "num_layers": 6, "vocab_size": 4096, "hidden_size": 64, "head_dim": 16}
    architecture.update(num_attention_heads=4, num_kv_heads=2, intermediate_size=128)
    provider = family_provider(get_family("qwen3"))
    parallel = {} if split is None else {"stage_split": split}
    return provider(provider.Config.model_validate({"architecture": architecture, "parallel": parallel}))


def test_the_provider_builds_each_stage_with_its_layers() -> None:
    import torch

    for split, expected in [
        ({"kind": "layers", "layers": [2, 3, 1]}, (2, 3, 1)),
        (None, (1, 3, 2)),  # even: stage costs 2, 3, 3 with the embedding and the head
        ({"kind": "flops"}, None),  # whatever the cost model says, as the stages hold it
    ]:
        provider = _provider(split)
        counts = provider.stage_layer_counts(3)
        if expected is not None:
            assert counts == expected
        held = []
        for stage in range(3):
            with torch.device("meta"):
                module = provider.build_stage(PipelineStageInfo(stage, 3))
            held.append(sorted(module.model.decoder_layers()))
        assert held == [list(r) for r in _ranges(counts)], split


def _ranges(counts: tuple[int, ...]) -> list[range]:
    starts = list(itertools.accumulate((0, *counts)))
    return [range(a, b) for a, b in itertools.pairwise(starts)]


def test_bad_splits_are_refused_naming_the_problem() -> None:
    uniform = StageCosts.uniform(4)
    with pytest.raises(ValueError, match="sum to the model's 4 layers"):
        build_stage_split(LayersSplit(layers=(2, 1)), 4, 2, None)
    with pytest.raises(ValueError, match="3 stage layer counts"):
        build_stage_split(LayersSplit(layers=(2, 1, 1)), 4, 2, None)
    with pytest.raises(ValueError, match="4 layers cannot be split over 5 stages"):
        build_stage_split(EvenSplit(), 4, 5, None)
    with pytest.raises(ValueError, match="kind flops needs the model family's cost model"):
        build_stage_split(FlopsSplit(), 4, 2, None)  # no silent even split
    assert build_stage_split(FlopsSplit(), 4, 2, lambda seq_len: uniform) == split_layers(uniform, 2)
    with pytest.raises(ValueError, match="one count >= 1 per stage"):
        PipelineStageInfo(0, 2, layer_counts=(3,))
