"""DistributedContext on real gloo ranks, checked against hand-computed layouts."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from d9d.core import DeviceMeshParameters, DistributedContext, MeshDomain
from tests.harness import RankEnv, run_distributed

# Each case: mesh params, and for each domain (shape, dim names, coordinates of ONE probed rank).
CASES: dict[
    str, tuple[dict[str, int], int, dict[str, tuple[tuple[int, ...], tuple[str, ...], dict[str, int]]]]
] = {
    "single": (
        {},
        0,
        {
            "regular": (
                (1, 1, 1, 1, 1),
                ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
                {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0},
            ),
            "dense": (
                (1, 1, 1, 1),
                ("pp", "dp_cp_replicate", "dp_cp_shard", "tp"),
                {"pp": 0, "dp_cp_replicate": 0, "dp_cp_shard": 0, "tp": 0},
            ),
            "expert": (
                (1, 1, 1),
                ("pp", "ep_replicate", "ep_shard"),
                {"pp": 0, "ep_replicate": 0, "ep_shard": 0},
            ),
            "batch": ((1, 1, 1, 1), ("pp", "dp", "cp", "tp"), {"pp": 0, "dp": 0, "cp": 0, "tp": 0}),
            "flat": ((1,), ("world",), {"world": 0}),
        },
    ),
    # pp2 x dp2 (replicate): ranks [[0,1],[2,3]]; rank 3 -> pp1, dp_replicate 1.
    "pp2_dp2": (
        {"pipeline_parallel": 2, "data_parallel_replicate": 2},
        3,
        {
            "regular": (
                (2, 2, 1, 1, 1),
                ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
                {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 0},
            ),
            "dense": (
                (2, 2, 1, 1),
                ("pp", "dp_cp_replicate", "dp_cp_shard", "tp"),
                {"pp": 1, "dp_cp_replicate": 1, "dp_cp_shard": 0, "tp": 0},
            ),
            "expert": (
                (2, 2, 1),
                ("pp", "ep_replicate", "ep_shard"),
                {"pp": 1, "ep_replicate": 1, "ep_shard": 0},
            ),
            "batch": ((2, 2, 1, 1), ("pp", "dp", "cp", "tp"), {"pp": 1, "dp": 1, "cp": 0, "tp": 0}),
            "flat": ((4,), ("world",), {"world": 3}),
        },
    ),
    # dp_shard2 x ep2: the expert dim covers both dp ranks; rank 1 is expert shard 1.
    "dp2_ep2": (
        {"data_parallel_shard": 2, "expert_parallel": 2},
        1,
        {
            "regular": (
                (1, 1, 2, 1, 1),
                ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
                {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0},
            ),
            "dense": (
                (1, 1, 2, 1),
                ("pp", "dp_cp_replicate", "dp_cp_shard", "tp"),
                {"pp": 0, "dp_cp_replicate": 0, "dp_cp_shard": 1, "tp": 0},
            ),
            "expert": (
                (1, 1, 2),
                ("pp", "ep_replicate", "ep_shard"),
                {"pp": 0, "ep_replicate": 0, "ep_shard": 1},
            ),
            "batch": ((1, 2, 1, 1), ("pp", "dp", "cp", "tp"), {"pp": 0, "dp": 1, "cp": 0, "tp": 0}),
            "flat": ((2,), ("world",), {"world": 1}),
        },
    ),
    # dp_replicate2 x dp_shard2 with ep2: experts over the two shard ranks, replicated over the replicas.
    # rank 2 = (dpr 1, dps 0) -> ep_replicate 1, ep_shard 0.
    "dp4_ep2": (
        {"data_parallel_replicate": 2, "data_parallel_shard": 2, "expert_parallel": 2},
        2,
        {
            "regular": (
                (1, 2, 2, 1, 1),
                ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
                {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 0},
            ),
            "dense": (
                (1, 2, 2, 1),
                ("pp", "dp_cp_replicate", "dp_cp_shard", "tp"),
                {"pp": 0, "dp_cp_replicate": 1, "dp_cp_shard": 0, "tp": 0},
            ),
            "expert": (
                (1, 2, 2),
                ("pp", "ep_replicate", "ep_shard"),
                {"pp": 0, "ep_replicate": 1, "ep_shard": 0},
            ),
            "batch": ((1, 4, 1, 1), ("pp", "dp", "cp", "tp"), {"pp": 0, "dp": 2, "cp": 0, "tp": 0}),
            "flat": ((4,), ("world",), {"world": 2}),
        },
    ),
    # pp2 x dp_shard2 x ep2 on 4 ranks; rank 3 = pp1, dps1.
    "pp2_fsdp2_ep2": (
        {"pipeline_parallel": 2, "data_parallel_shard": 2, "expert_parallel": 2},
        3,
        {
            "regular": (
                (2, 1, 2, 1, 1),
                ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
                {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0},
            ),
            "dense": (
                (2, 1, 2, 1),
                ("pp", "dp_cp_replicate", "dp_cp_shard", "tp"),
                {"pp": 1, "dp_cp_replicate": 0, "dp_cp_shard": 1, "tp": 0},
            ),
            "expert": (
                (2, 1, 2),
                ("pp", "ep_replicate", "ep_shard"),
                {"pp": 1, "ep_replicate": 0, "ep_shard": 1},
            ),
            "batch": ((2, 2, 1, 1), ("pp", "dp", "cp", "tp"), {"pp": 1, "dp": 1, "cp": 0, "tp": 0}),
            "flat": ((4,), ("world",), {"world": 3}),
        },
    ),
    # 8 ranks: pp2 x dp_shard2 x cp_shard2, ep4. Physical (pp, dpr, dps, cpr, cps, tp) = (2,1,2,1,2,1).
    # rank 6 = pp1, dps1, cps0. Dense fuses dps x cps -> index 1*2+0 = 2. Expert: non-pp index 2 -> (0, 2).
    "pp2_fsdp2_cp2_ep4": (
        {"pipeline_parallel": 2, "data_parallel_shard": 2, "context_parallel_shard": 2, "expert_parallel": 4},
        6,
        {
            "regular": (
                (2, 1, 2, 2, 1),
                ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
                {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0},
            ),
            "dense": (
                (2, 1, 4, 1),
                ("pp", "dp_cp_replicate", "dp_cp_shard", "tp"),
                {"pp": 1, "dp_cp_replicate": 0, "dp_cp_shard": 2, "tp": 0},
            ),
            "expert": (
                (2, 1, 4),
                ("pp", "ep_replicate", "ep_shard"),
                {"pp": 1, "ep_replicate": 0, "ep_shard": 2},
            ),
            "batch": ((2, 2, 2, 1), ("pp", "dp", "cp", "tp"), {"pp": 1, "dp": 1, "cp": 0, "tp": 0}),
            "flat": ((8,), ("world",), {"world": 6}),
        },
    ),
    # 8 ranks: dp_replicate2 x cp_replicate2 x tp2 (dense replicate fuses dp_replicate with cp_replicate).
    # rank 5 = (dpr1, cpr0, tp1). Dense replicate index = 1*2+0 = 2.
    "hsdp_cp_tp": (
        {"data_parallel_replicate": 2, "context_parallel_replicate": 2, "tensor_parallel": 2},
        5,
        {
            "regular": (
                (1, 2, 1, 2, 2),
                ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
                {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1},
            ),
            "dense": (
                (1, 4, 1, 2),
                ("pp", "dp_cp_replicate", "dp_cp_shard", "tp"),
                {"pp": 0, "dp_cp_replicate": 2, "dp_cp_shard": 0, "tp": 1},
            ),
            "expert": (
                (1, 8, 1),
                ("pp", "ep_replicate", "ep_shard"),
                {"pp": 0, "ep_replicate": 5, "ep_shard": 0},
            ),
            "batch": ((1, 2, 2, 2), ("pp", "dp", "cp", "tp"), {"pp": 0, "dp": 1, "cp": 0, "tp": 1}),
            "flat": ((8,), ("world",), {"world": 5}),
        },
    ),
}


def _check_case(env: RankEnv, case: str) -> None:
    params_kwargs, probe, expected = CASES[case]
    ctx = DistributedContext.create(DeviceMeshParameters(**params_kwargs), backend="gloo")
    assert ctx.rank == env.rank and ctx.world_size == env.world_size
    assert ctx.device == torch.device("cpu")
    assert ctx.is_main_process == (env.rank == 0)
    for domain, (shape, names, probe_coords) in expected.items():
        mesh = ctx.mesh_for(domain)
        assert tuple(mesh.shape) == shape, (domain, tuple(mesh.shape))
        assert mesh.mesh_dim_names == names, (domain, mesh.mesh_dim_names)
        coords = ctx.coordinates(domain)
        # The DeviceMesh and our layout must agree on where this rank sits.
        assert tuple(mesh.get_coordinate() or ()) == tuple(coords[n] for n in names), domain
        if env.rank == probe:
            assert coords == probe_coords, (domain, coords)
        # A collective over each dim reaches exactly the ranks the layout says share that group.
        layout = ctx.layout(domain)
        for dim, name in enumerate(names):
            group = mesh.get_group(name)
            members = torch.tensor([float(env.rank)])
            gathered = [torch.zeros(1) for _ in range(mesh.size(dim))]
            dist.all_gather(gathered, members, group=group)
            index = [coords[n] if n != name else slice(None) for n in names]
            assert [int(g.item()) for g in gathered] == layout.ranks[tuple(index)].tolist(), (domain, name)
    ctx.set_timeout(datetime.timedelta(seconds=30))
    with ctx.main_process_first():
        marker = env.tmp_dir / "main-was-here"
        if ctx.is_main_process:
            marker.write_text("x")
        else:
            assert marker.exists(), "a non-main rank ran before the main rank finished"
    ctx.logger.info("checked %s", case)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("case", "world_size"),
    [
        ("single", 1),
        ("pp2_dp2", 4),
        ("dp2_ep2", 2),
        ("dp4_ep2", 4),
        ("pp2_fsdp2_ep2", 4),
        ("pp2_fsdp2_cp2_ep4", 8),
        ("hsdp_cp_tp", 8),
    ],
)
def test_domains_match_hand_computed_layouts(case: str, world_size: int) -> None:
    run_distributed(_check_case, world_size, case, timeout=120)


def _wrong_world(env: RankEnv) -> None:
    try:
        DistributedContext.create(DeviceMeshParameters(data_parallel_shard=4), backend="gloo")
    except ValueError as e:
        assert "mesh product 4" in str(e) and "data_parallel_shard=4" in str(e) and "world size 2" in str(e)
    else:
        raise AssertionError("a 4-rank mesh on 2 ranks was accepted")


@pytest.mark.distributed
def test_mesh_that_does_not_fit_the_world_is_refused() -> None:
    run_distributed(_wrong_world, 2, timeout=60)


def test_invalid_parameters_name_the_field() -> None:
    with pytest.raises(ValidationError, match="tensor_parallel"):
        DeviceMeshParameters(tensor_parallel=0)
    with pytest.raises(ValidationError, match="expert_parallel=3 must divide"):
        DeviceMeshParameters(data_parallel_shard=4, expert_parallel=3)
    with pytest.raises(ValidationError, match="pipline_parallel"):
        DeviceMeshParameters(pipline_parallel=2)  # type: ignore[call-arg]
    params = DeviceMeshParameters(pipeline_parallel=2, data_parallel_shard=2)
    with pytest.raises(ValidationError):
        params.pipeline_parallel = 4  # type: ignore[misc]


def test_local_context_has_layouts_but_no_mesh() -> None:
    ctx = DistributedContext.local()
    assert ctx.is_main_process and ctx.is_local_main_process and not ctx.is_distributed
    assert ctx.coordinates("expert") == {"pp": 0, "ep_replicate": 0, "ep_shard": 0}
    with pytest.raises(RuntimeError, match="single-process"):
        ctx.mesh_for(MeshDomain.DENSE)
    with ctx.main_process_first():
        pass


def test_nccl_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: nccl is valid here")
    from d9d.core import resolve_backend

    with pytest.raises(RuntimeError, match="no CUDA device"):
        resolve_backend("nccl")
    assert resolve_backend("auto") == "gloo"
