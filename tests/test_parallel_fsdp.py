"""FSDP / HSDP (with and without expert parallelism) against a single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from d9d.core import DeviceMeshParameters, DistributedContext, MeshDomain
from d9d.parallel import GradientSynchronizer, GradSyncConfig, collect_synced_params
from d9d.parallel.expert import AllToAllBackendConfig, parallelize_expert_parallel
from d9d.parallel.fsdp import parallelize_fsdp, parallelize_hsdp
from tests.harness import RankEnv, run_distributed
from tests.test_parallel_expert import TinyMoE, _moe_batches, _moe_loss
from tests.test_parallel_reference import (
    assert_runs_close,
    distributed_run,
    full_state,
    load_full_state,
    reference_run,
)
from tests.test_parallel_replicate import _global_batches, _loss, _mlp

pytestmark = pytest.mark.distributed


def _fsdp_cases(env: RankEnv) -> None:
    world = env.world_size
    mlp_batches = _global_batches(3, 16)
    mlp_ref = reference_run(_mlp(), mlp_batches, _loss, max_norm=0.05)
    moe_batches = _moe_batches(3, 16)
    moe_init = full_state(TinyMoE())
    moe_ref = reference_run(TinyMoE(), moe_batches, _moe_loss, max_norm=0.5)
    cases = [  # (replicate, shard, ep, model)
        (1, world, 1, "mlp"),
        (2, world // 2, 1, "mlp"),
        (1, world, 2, "moe"),
        (2, world // 2, 2, "moe"),
    ]
    for replicate, shard, ep, kind in cases:
        case = f"dp_replicate={replicate} dp_shard={shard} ep={ep} {kind}"
        ctx = DistributedContext.create(
            DeviceMeshParameters(
                data_parallel_replicate=replicate, data_parallel_shard=shard, expert_parallel=ep
            ),
            backend="gloo",
        )
        dense = ctx.mesh_for(MeshDomain.DENSE)
        model = _mlp() if kind == "mlp" else TinyMoE()
        if kind == "moe":
            expert_mesh = ctx.mesh_for(MeshDomain.EXPERT)["ep_replicate", "ep_shard"]
            parallelize_expert_parallel(
                model.moe,
                expert_mesh,
                device=ctx.device,
                dtype=torch.float32,
                backend=AllToAllBackendConfig(),
            )
        units = [m for m in model.modules() if isinstance(m, nn.Linear)] if kind == "mlp" else [model.moe]
        if replicate == 1:
            parallelize_fsdp(model, dense["dp_cp_shard"], units=units)
        else:
            parallelize_hsdp(model, dense["dp_cp_replicate", "dp_cp_shard"], units=units)
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), (case, name)
            if "experts" not in name:
                assert p.device_mesh.mesh_dim_names == ("dp_cp_shard",) and p.placements == (Shard(0),), (
                    case,
                    name,
                )
        if kind == "moe":
            load_full_state(model, moe_init)
        batches, ref, loss = (
            (mlp_batches, mlp_ref, _loss) if kind == "mlp" else (moe_batches, moe_ref, _moe_loss)
        )
        max_norm = 0.05 if kind == "mlp" else 0.5
        sync = GradientSynchronizer(
            collect_synced_params(model),
            GradSyncConfig(bucket_size_mb=1e-5),
            loss_weight_mesh=ctx.mesh_for(MeshDomain.BATCH)["dp"],
        )
        local = [b.shard(world, env.rank).split(2) for b in batches]
        got = distributed_run(model, sync, local, loss, max_norm=max_norm)
        assert_runs_close(got, ref, case)
        sync.close()


def test_fsdp_and_hsdp_match_single_process() -> None:
    run_distributed(_fsdp_cases, 4, timeout=240)


def _hsdp_overlap(env: RankEnv) -> None:
    """HSDP's cross-replica all-reduce is the synchronizer's, started from FSDP's post-reduce-scatter hook
    while backward still runs through earlier layers."""
    ctx = DistributedContext.create(
        DeviceMeshParameters(data_parallel_replicate=2, data_parallel_shard=2), backend="gloo"
    )
    dense = ctx.mesh_for(MeshDomain.DENSE)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    parallelize_hsdp(model, dense["dp_cp_replicate", "dp_cp_shard"], units=list(model))
    sync = GradientSynchronizer(collect_synced_params(model), GradSyncConfig(bucket_size_mb=1e-6))
    events: list[str] = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        events.append("all_reduce")
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce  # type: ignore[assignment]
    try:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(env.rank)).requires_grad_()
        x.register_hook(lambda grad: events.append("input_grad"))
        model(x).sum().backward()
        sync.wait()
    finally:
        dist.all_reduce = real_all_reduce  # type: ignore[assignment]
    assert events.count("all_reduce") == 8, events  # weight and bias of 4 layers, one bucket each
    assert events.index("input_grad") >= 6, events  # layers 3, 2, 1 were reduced before backward reached x
    sync.close()


def test_hsdp_replica_reduction_overlaps_backward() -> None:
    run_distributed(_hsdp_overlap, 4, timeout=120)
