"""RNG snapshots and DTensor initialization that does not depend on the sharding."""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from d9d.core import DeviceMeshParameters, DistributedContext, MeshDomain
from d9d.determinism import (
    RankSeeds,
    capture_rng_state,
    full_tensor_random,
    parameter_init_rng,
    restore_rng_state,
    seed_everything,
)
from tests.harness import RankEnv, run_distributed


def _draw() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_capture_restore_all_generators_through_checkpoint() -> None:
    seed_everything(5)
    _draw()
    np.random.randn()  # leave numpy with a cached gaussian
    buf = io.BytesIO()
    torch.save(capture_rng_state(), buf)
    expected = [_draw() for _ in range(3)]
    seed_everything(99)
    buf.seek(0)
    restore_rng_state(torch.load(buf, weights_only=True))
    assert [_draw() for _ in range(3)] == expected


def test_restore_keeps_numpy_gaussian_cache() -> None:
    seed_everything(1)
    np.random.randn()  # a gaussian pair is drawn, one value is cached
    state = capture_rng_state()
    expected = np.random.randn(3)
    restore_rng_state(state)
    np.testing.assert_array_equal(np.random.randn(3), expected)


def test_seed_everything_reproduces() -> None:
    seed_everything(3)
    a = _draw()
    seed_everything(3)
    assert _draw() == a


def test_incomplete_snapshot_names_missing_key() -> None:
    state = capture_rng_state()
    del state["numpy"]
    with pytest.raises(KeyError, match="numpy"):
        restore_rng_state(state)


_INITS: dict[str, Callable[[torch.Tensor], object]] = {
    "normal": lambda t: torch.nn.init.normal_(t, std=0.02),
    "uniform": lambda t: torch.nn.init.uniform_(t, -1.0, 1.0),
    "trunc_normal": lambda t: torch.nn.init.trunc_normal_(t, std=0.5),
    "kaiming": lambda t: torch.nn.init.kaiming_uniform_(t, a=5**0.5),
}


def _reference(shape: tuple[int, ...], seed: int, init: str) -> torch.Tensor:
    seed_everything(seed)
    full = torch.empty(shape)
    _INITS[init](full)
    return full


def _sharded_init_body(env: RankEnv) -> None:
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    cases: list[tuple[tuple[int, ...], list[Placement]]] = [
        ((8, 6), [Shard(0), Shard(1)]),
        ((7, 5), [Shard(0), Replicate()]),  # uneven shards
        ((6, 4), [Replicate(), Shard(1)]),
        ((4, 4), [Replicate(), Replicate()]),
        ((8, 4), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 over a TP-sharded dim
    ]
    for init in _INITS:
        for shape, placements in cases:
            ref = _reference(shape, 11, init)
            param = distribute_tensor(torch.empty(shape), mesh2d, placements)
            with parameter_init_rng(11, mesh2d):
                _INITS[init](param)
            assert isinstance(param, DTensor)
            torch.testing.assert_close(param.full_tensor(), ref, rtol=0, atol=0, msg=f"{init} {placements}")
    # Several parameters in a row: the generator advances identically on every rank.
    with parameter_init_rng(3, mesh2d):
        first = distribute_tensor(torch.empty(4, 4), mesh2d, [Shard(0), Shard(1)])
        second = distribute_tensor(torch.empty(4, 4), mesh2d, [Shard(1), Replicate()])
        first.normal_()
        second.uniform_()
    seed_everything(3)
    torch.testing.assert_close(first.full_tensor(), torch.empty(4, 4).normal_(), rtol=0, atol=0)
    torch.testing.assert_close(second.full_tensor(), torch.empty(4, 4).uniform_(), rtol=0, atol=0)


@pytest.mark.distributed
def test_sharded_init_equals_unsharded_on_cpu() -> None:
    run_distributed(_sharded_init_body, 4, timeout=120)


def _without_mode_body(env: RankEnv) -> None:
    # Documents the CPU problem the mode fixes: plain DTensor init repeats the same numbers in each shard.
    mesh = init_device_mesh("cpu", (2,))
    param = distribute_tensor(torch.empty(4, 3), mesh, [Shard(0)])
    seed_everything(0)
    param.normal_()
    full = param.full_tensor()
    assert torch.equal(full[:2], full[2:])
    seed_everything(0)
    with full_tensor_random():
        param.normal_()
    full = param.full_tensor()
    assert not torch.equal(full[:2], full[2:])


@pytest.mark.distributed
def test_plain_cpu_dtensor_init_duplicates_shards() -> None:
    run_distributed(_without_mode_body, 2, timeout=60)


def _stage_init_body(env: RankEnv) -> None:
    params = DeviceMeshParameters(pipeline_parallel=2, data_parallel_shard=2)
    ctx = DistributedContext.create(params, backend="gloo")
    seeds = RankSeeds.for_rank(params, ctx.rank, base_seed=42)
    stage_mesh = ctx.mesh_for(MeshDomain.REGULAR)["dp_shard"]
    weight = distribute_tensor(torch.empty(6, 4), stage_mesh, [Shard(0)])
    with parameter_init_rng(seeds.parameters, stage_mesh):
        _INITS["normal"](weight)
    full = weight.full_tensor()
    torch.testing.assert_close(full, _reference((6, 4), seeds.parameters, "normal"), rtol=0, atol=0)
    torch.save(full, env.tmp_dir / f"stage{ctx.coordinates()['pp']}-rank{ctx.rank}.pt")


@pytest.mark.distributed
def test_stages_differ_replicas_agree(tmp_path) -> None:
    run_distributed(_stage_init_body, 4, tmp_dir=tmp_path, timeout=120)
    s0 = [torch.load(p) for p in sorted(tmp_path.glob("stage0-*.pt"))]
    s1 = [torch.load(p) for p in sorted(tmp_path.glob("stage1-*.pt"))]
    assert len(s0) == len(s1) == 2
    assert torch.equal(s0[0], s0[1]) and torch.equal(s1[0], s1[1])
    assert not torch.equal(s0[0], s1[0])


@pytest.mark.gpu
def test_cuda_dtensor_seeding_matches_unsharded() -> None:
    run_distributed(_cuda_body, 1, timeout=120)


def _cuda_body(env: RankEnv) -> None:
    mesh = init_device_mesh("cuda", (1,))
    param = distribute_tensor(torch.empty(8, 4, device="cuda"), mesh, [Shard(0)])
    with parameter_init_rng(5, mesh):
        torch.nn.init.normal_(param)
    seed_everything(5)
    ref = torch.empty(8, 4, device="cuda").normal_()
    torch.testing.assert_close(param.to_local(), ref, rtol=0, atol=0)  # one rank: the shard is everything


def _zbv_job(tmp: Path) -> dict[str, Any]:
    architecture = {
        "vocab_size": 64,
        "hidden_size": 16,
        "num_layers": 6,
        "num_attention_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
        "intermediate_size": 32,
    }
    return {
        "run": {"name": "zbv-init", "dir": str(tmp / "run")},
        "mesh": {"pipeline_parallel": 2},
        "pipelining": {"kind": "zbv"},
        "batching": {"global_batch_size": 4, "microbatch_size": 1},
        "trainer": {"total_steps": 1},
        "logging": {"progress_bar": "off"},
        "model": {"provider": "qwen3", "options": {"architecture": architecture}},  # random init
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "stochastic_adamw", "options": {"lr": 1e-3}},
    }


def _zbv_stages_body(env: RankEnv) -> None:
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.config import parse_config
    from d9d.engine.trainer import Trainer

    config = parse_config(_zbv_job(env.tmp_dir))
    trainer = Trainer(
        config, DistributedContext.create(config.mesh), LocalRunReporter(config.checkpoint_dir, 1)
    )
    trainer.setup()
    layers = {
        name: p.detach().clone()
        for module in trainer.modules
        for name, p in module.named_parameters()
        if name.endswith("self_attn.q_proj.weight")
    }
    seeds = {
        s: [g["seed"] for g in opt.param_groups] for s, opt in trainer.parts.optimizer.optimizers.items()
    }
    torch.save((layers, seeds), env.tmp_dir / f"rank{env.rank}.pt")


@pytest.mark.distributed
def test_stages_on_one_rank_draw_their_own_init_and_rounding(tmp_path: Path) -> None:
    """ZBV puts two stages on each rank; rank 1's two hold only decoder layers, of the same shapes. Each
    stage draws its own initial weights and stochastic-rounding stream (regression: both stages re-seeded
    the rank's seed, so their layers started identical and rounded with the same bits), and `d9d export`,
    which rebuilds every stage in one process, seeds each stage as its rank's training did."""
    from d9d.engine.config import parse_config
    from d9d.engine.export import _stages

    run_distributed(_zbv_stages_body, 2, tmp_dir=tmp_path, timeout=200)
    exported = {stage.info.current_stage: stage.seed for stage in _stages(parse_config(_zbv_job(tmp_path)))}
    for rank in (0, 1):
        layers, seeds = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(layers) >= 2 and len(seeds) == 2, (layers.keys(), seeds)
        assert len({seed for group_seeds in seeds.values() for seed in group_seeds}) == 2, seeds
        assert all(group_seeds == [exported[s]] for s, group_seeds in seeds.items()), (seeds, exported)
        weights = list(layers.values())
        for i, a in enumerate(weights):
            for b in weights[i + 1 :]:
                assert not torch.equal(a, b), list(layers)
