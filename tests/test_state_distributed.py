"""Distributed load/save on gloo ranks: DTensor shards materialized directly, per-rank shards merged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import d9d.state.io.reader as reader_module
from d9d.state import (
    INDEX_NAME,
    CheckpointFormatError,
    Distribute,
    ShardingSpec,
    StateGroup,
    load_model_state,
    save_model_state,
)
from tests.harness import RankEnv, run_distributed
from tests.test_state_io import assert_bitwise, expected_d9d, hf_state, hf_to_d9d, load_dir, write_hf_sharded

PLACEMENTS = {
    "shard0": ((4,), (Shard(0),)),
    "shard0_2rank": ((2,), (Shard(0),)),
    "shard0_replicate": ((2, 2), (Shard(0), Replicate())),
    "replicate_shard1": ((2, 2), (Replicate(), Shard(1))),
}


def placements_for(layout: str, ndim: int) -> tuple[Shard | Replicate, ...]:
    """The layout's placements; a dim a tensor lacks (1-D norms under Shard(1)) is replicated instead."""
    return tuple(Replicate() if isinstance(p, Shard) and p.dim >= ndim else p for p in PLACEMENTS[layout][1])


def make_module(shapes: dict[str, torch.Size]) -> nn.Module:
    """A module whose state-dict keys are exactly `shapes` (nested submodules for dotted names)."""
    root = nn.Module()
    for key, shape in shapes.items():
        *path, leaf = key.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(torch.full(shape, -1.0, dtype=torch.bfloat16)))
    return root


def _dtensor_load_save(env: RankEnv, ckpt: str, layout: str) -> None:
    mesh_shape = PLACEMENTS[layout][0]
    mesh = init_device_mesh("cpu", mesh_shape)
    full = expected_d9d(hf_state())
    module = make_module({k: v.shape for k, v in full.items()})
    for name, param in list(module.named_parameters()):
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        sharded = distribute_tensor(param.detach(), mesh, list(placements_for(layout, param.dim())))
        owner.register_parameter(name.rpartition(".")[2], nn.Parameter(sharded))

    load_model_state(ckpt, module, hf_to_d9d())

    # Independent reference: torch.chunk along each sharded dim at this rank's mesh coordinate.
    coords = mesh.get_coordinate()
    assert coords is not None
    for key, param in module.state_dict().items():
        placements = placements_for(layout, param.dim())
        assert isinstance(param, DTensor) and param.placements == placements, key
        expected = full[key]
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                expected = torch.chunk(expected, mesh.size(mesh_dim), dim=placement.dim)[coords[mesh_dim]]
        assert torch.equal(param.to_local(), expected), (env.rank, key)

    # Distribute cuts the slice itself; it must agree with torch's distribute_tensor, uneven and empty
    # shards included.
    for shape in [(2, 3), (5, 7), (1,), (0, 4), (9, 2, 3)]:
        full_t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        spec = ShardingSpec(mesh, placements_for(layout, len(shape)))
        ours = Distribute({"t": spec}).apply(StateGroup.of(["t"], ["t"]), {"t": full_t})["t"]
        ref = distribute_tensor(full_t, mesh, list(spec.placements), src_data_rank=None)
        assert ours.placements == ref.placements and ours.shape == ref.shape and ours.stride() == ref.stride()
        assert torch.equal(ours.to_local(), ref.to_local()), (env.rank, shape)
        assert torch.equal(ours.full_tensor(), full_t)

    dest = env.tmp_dir / f"out-{layout}"
    # write="auto": every rank gathers (a collective), the lowest rank alone writes each gathered key
    save_model_state(dest, module, hf_to_d9d().inverse(), distributed=True, max_shard_bytes=600)
    assert_bitwise(load_dir(dest), hf_state())
    assert len(json.loads((dest / INDEX_NAME).read_text())["weight_map"]) == len(hf_state())


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "layout"),
    [(2, "shard0_2rank"), (4, "shard0"), (4, "shard0_replicate"), (4, "replicate_shard1")],
)
def test_dtensor_shards_load_and_save(tmp_path, world_size, layout):
    write_hf_sharded(tmp_path / "hf", hf_state(), 3)
    run_distributed(_dtensor_load_save, world_size, str(tmp_path / "hf"), layout, timeout=90)


def _stage_keys(rank: int, layers: int) -> list[str]:
    """Pipeline-like ownership: rank r holds layer r, rank 0 also the embedding."""
    keys = [k for k in expected_d9d(hf_state(layers), layers) if k.startswith(f"layers.{rank}.")]
    return [*keys, "embed.weight"] if rank == 0 else keys


def _pipeline_load_save(env: RankEnv, ckpt: str) -> None:
    layers = env.world_size
    full = expected_d9d(hf_state(layers), layers)
    mine = _stage_keys(env.rank, layers)
    module = make_module({k: full[k].shape for k in mine})
    read: list[str] = []
    real = reader_module.read_tensor
    reader_module.read_tensor = lambda f, p, k, e: (read.append(k), real(f, p, k, e))[1]  # type: ignore[assignment]
    try:
        load_model_state(ckpt, module, hf_to_d9d(layers))
    finally:
        reader_module.read_tensor = real
    # This rank read exactly the HF keys of its own stage, nothing else.
    own_prefixes = (f"model.layers.{env.rank}.", *(("model.embed",) if env.rank == 0 else ()))
    assert sorted(read) == sorted(k for k in hf_state(layers) if k.startswith(own_prefixes))
    assert_bitwise(module.state_dict(), {k: full[k] for k in mine})

    dest = env.tmp_dir / "out"
    path = save_model_state(
        dest, module, hf_to_d9d(layers).inverse(), distributed=True, max_shard_bytes=10**6
    )
    assert path == dest
    index = json.loads((dest / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) == env.world_size  # one shard per rank, merged by rank 0
    assert_bitwise(load_dir(dest), hf_state(layers))


@pytest.mark.distributed
def test_pipeline_ranks_read_only_their_keys_and_merge_one_index(tmp_path):
    write_hf_sharded(tmp_path / "hf", hf_state(4), 2)
    run_distributed(_pipeline_load_save, 4, str(tmp_path / "hf"), timeout=90)


def _replicated_save(env: RankEnv) -> None:
    state = {"shared": torch.ones(3)} if env.rank < 2 else {"own": torch.zeros(1)}
    # write="auto" (default): the lowest rank holding a key writes it, replicas write nothing.
    save_model_state(env.tmp_dir / "auto", state, distributed=True, extra_files={"config.json": "{}"})
    assert_bitwise(load_dir(env.tmp_dir / "auto"), {"shared": torch.ones(3), "own": torch.zeros(1)})
    assert (env.tmp_dir / "auto" / "config.json").read_text() == "{}"
    # Forcing every rank to write its copy is a collision, reported on every rank, nothing committed.
    with pytest.raises(
        CheckpointFormatError, match="'shared' was written by ranks 0 and 1; use write='auto'"
    ):
        save_model_state(env.tmp_dir / "out", state, distributed=True, write=True)
    assert not (env.tmp_dir / "out").exists()
    assert not list(env.tmp_dir.glob(".out.*"))


def _failing_rank(env: RankEnv) -> None:
    from d9d.state import Identity, StateWriter

    writer = StateWriter(env.tmp_dir / "out", Identity(["a", "b"]), distributed=True)
    writer.add("a", torch.ones(1))
    if env.rank == 0:
        writer.add("b", torch.ones(1))
    # Rank 1 never gets 'b': every rank must learn it and nothing is committed.
    with pytest.raises(CheckpointFormatError, match=r"rank 1: StateMappingError: .*incomplete.*\['b'\]"):
        writer.commit()
    assert not Path(env.tmp_dir / "out").exists()


@pytest.mark.distributed
def test_replicas_write_once_and_failures_reach_every_rank():
    run_distributed(_replicated_save, 3, timeout=60)
    run_distributed(_failing_rank, 2, timeout=60)


def test_single_process_checkpoint_is_readable_by_ranks(tmp_path):
    """The non-distributed writer's output is what the distributed tests read: keep them honest."""
    hf = hf_state()
    save_file(hf, str(tmp_path / "ref.safetensors"))
    assert_bitwise(load_dir(save_model_state(tmp_path / "c", hf, max_shard_bytes=500)), hf)
