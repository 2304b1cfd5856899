"""Replicated data parallelism and the gradient synchronizer against a single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from d9d.core import DeviceMeshParameters, DistributedContext, MeshDomain
from d9d.parallel import (
    GradientSynchronizer,
    GradSyncConfig,
    collect_synced_params,
    parallelize_replicate,
    replicate_plain,
)
from tests.harness import RankEnv, run_distributed
from tests.test_parallel_reference import (
    Batch,
    assert_runs_close,
    distributed_run,
    reference_run,
)

pytestmark = pytest.mark.distributed


def _mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 12), nn.LayerNorm(12), nn.GELU(), nn.Linear(12, 12), nn.GELU(), nn.Linear(12, 3)
    ).to(dtype)


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    per_sample = (model(batch.inputs) - batch.targets).pow(2).sum(-1)
    return (per_sample * batch.weights).sum()


def _global_batches(steps: int, size: int, seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        weights = torch.randint(0, 4, (size,), generator=g).float()  # uneven, with zeros
        out.append(Batch(torch.randn(size, 6, generator=g), torch.randn(size, 3, generator=g), weights))
    return out


def _replicate(model: nn.Module, mesh: DeviceMesh, plain: bool) -> None:
    """Replicas as the decoder plan makes them: plain parameters (no DTensor anywhere), or `Replicate`
    DTensors (beside tensor or expert parallelism)."""
    if plain:
        replicate_plain(model, mesh)
        assert not any(isinstance(p, DTensor) for p in model.parameters())
    else:
        parallelize_replicate(model, mesh)
        assert all(isinstance(p, DTensor) and p.placements == (Replicate(),) for p in model.parameters())


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _dp_cases(env: RankEnv, plain: bool) -> None:
    ctx = DistributedContext.create(
        DeviceMeshParameters(data_parallel_replicate=env.world_size), backend="gloo"
    )
    mesh = ctx.mesh_for(MeshDomain.DENSE)["dp_cp_replicate"]
    batches = _global_batches(3, 16)
    for max_norm, microbatches, bucket_mb in ((None, 2, 25.0), (0.05, 4, 1e-6)):
        case = f"max_norm={max_norm} microbatches={microbatches} bucket_mb={bucket_mb} plain={plain}"
        ref = reference_run(_mlp(), batches, _loss, max_norm=max_norm)
        model = _mlp()
        _replicate(model, mesh, plain)
        sync = GradientSynchronizer(
            collect_synced_params(model),
            GradSyncConfig(bucket_size_mb=bucket_mb),
            loss_weight_mesh=ctx.mesh_for(MeshDomain.BATCH)["dp"],
        )
        if bucket_mb < 1e-5:
            assert len(sync.buckets) == len(list(model.parameters())), case  # one parameter per bucket
        local = [b.shard(env.world_size, env.rank).split(microbatches) for b in batches]
        got = distributed_run(model, sync, local, _loss, max_norm=max_norm)
        assert_runs_close(got, ref, case)
        sync.close()


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "dtensor"])
def test_replicate_matches_single_process(plain: bool) -> None:
    run_distributed(_dp_cases, 2, plain, timeout=120)


class _Branchy(nn.Module):
    """A model whose `extra` branch is only used when asked: parameters unused on some ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(6, 6)
        self.extra = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)
        self.never = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_extra:
            h = h + self.extra(h)
        return self.b(h)


def _sync_behaviour(env: RankEnv, plain: bool) -> None:
    ctx = DistributedContext.create(
        DeviceMeshParameters(data_parallel_replicate=env.world_size), backend="gloo"
    )
    mesh = ctx.mesh_for(MeshDomain.DENSE)["dp_cp_replicate"]
    batch_mesh = ctx.mesh_for(MeshDomain.BATCH)["dp"]
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(4, 6, generator=g) for _ in range(env.world_size)]

    # 1. Buckets start reducing during backward: every layer's bucket but the first one's is launched before
    #    backward reaches the input; with two microbatches nothing is launched in the first backward.
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    _replicate(model, mesh, plain)
    sync = GradientSynchronizer(collect_synced_params(model), GradSyncConfig(bucket_size_mb=1e-6))
    events: list[str] = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        events.append(f"all_reduce:{tensor.numel()}")
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce  # type: ignore[assignment]
    try:
        for microbatches in (1, 2):
            events.clear()
            sync.set_num_microbatches(microbatches)
            for mb in range(microbatches):
                x = xs[env.rank].clone().requires_grad_()
                x.register_hook(lambda grad, mb=mb: events.append(f"input_grad:{mb}"))
                model(x).sum().backward()
            sync.wait()
            last_input = events.index(f"input_grad:{microbatches - 1}")
            assert events.count("all_reduce:36") + events.count("all_reduce:6") == 8, events
            launched_during_last_backward = [e for e in events[:last_input] if e.startswith("all_reduce")]
            assert len(launched_during_last_backward) >= 6, events  # layers 3, 2, 1 (weight and bias each)
            if microbatches == 2:
                first_input = events.index("input_grad:0")
                assert not any(e.startswith("all_reduce") for e in events[:first_input]), events
            sync.zero_grad()
    finally:
        dist.all_reduce = real_all_reduce  # type: ignore[assignment]
    sync.close()

    # 2. Parameters unused on some ranks (or on all) still get the right (or zero) gradient, no hang.
    model = _Branchy()
    ref = _Branchy()
    _replicate(model, mesh, plain)
    sync = GradientSynchronizer(collect_synced_params(model), loss_weight_mesh=batch_mesh)
    model(xs[env.rank], use_extra=env.rank == 0).sum().backward()
    total = sync.wait(float(xs[env.rank].shape[0]))
    assert total is not None and float(total) == 4.0 * env.world_size
    ref_loss = sum(ref(xs[r], use_extra=r == 0).sum() for r in range(env.world_size))
    assert isinstance(ref_loss, torch.Tensor)
    (ref_loss / total.float()).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        want = q.grad if q.grad is not None else torch.zeros_like(q)
        torch.testing.assert_close(
            _full(p.grad), want, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )

    # 3. Forgetting zero_grad is an error, not silently doubled gradients; so is an extra backward.
    sync.close()
    model = _mlp()
    _replicate(model, mesh, plain)
    sync = GradientSynchronizer(collect_synced_params(model))
    model(xs[env.rank]).sum().backward()
    sync.wait()
    with pytest.raises(RuntimeError, match="zero_grad"):
        model(xs[env.rank]).sum().backward()
    sync.zero_grad()
    model(xs[env.rank]).sum().backward()
    with pytest.raises(RuntimeError, match="num_microbatches=1"):
        model(xs[env.rank]).sum().backward()
    sync.close()
    #    ... also when the extra gradient's bucket has not been reduced yet (another parameter of it has
    #    not arrived).
    model = _mlp()
    _replicate(model, mesh, plain)
    sync = GradientSynchronizer(collect_synced_params(model), num_microbatches=2)  # one bucket
    head = model[-1]  # only the head's weight and bias get gradients: the bucket stays incomplete
    for _ in range(2):
        head(torch.ones(2, 12)).sum().backward()
    with pytest.raises(RuntimeError, match="once more than expected"):
        head(torch.ones(2, 12)).sum().backward()
    assert len(sync.buckets) == 1 and not sync.buckets[0].launched
    sync.close()

    # 4. bf16 parameters, float32 accumulation and reduction; the optimizer sees bf16 gradients.
    model = _mlp(dtype=torch.bfloat16)
    replica = _mlp(dtype=torch.bfloat16)
    _replicate(model, mesh, plain)
    sync = GradientSynchronizer(
        collect_synced_params(model),
        GradSyncConfig(grad_dtype="float32"),
        num_microbatches=2,
        loss_weight_mesh=batch_mesh,
    )
    assert {b.buffer.dtype for b in sync.buckets} == {torch.float32}
    halves = [x.to(torch.bfloat16).chunk(2) for x in xs]
    for half in halves[env.rank]:
        model(half).float().pow(2).sum().backward()
    sync.wait(8.0)
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in replica.parameters()]
    for rank_halves in halves:
        for half in rank_halves:
            replica.zero_grad(set_to_none=True)
            replica(half).float().pow(2).sum().backward()
            for acc, p in zip(expected, replica.parameters(), strict=True):
                acc += p.grad.float()
    for (name, p), want in zip(model.named_parameters(), expected, strict=True):
        assert p.grad.dtype == torch.bfloat16, name
        got = _full(p.grad).float()
        torch.testing.assert_close(
            got, (want / (8.0 * env.world_size)).bfloat16().float(), rtol=0, atol=0, msg=name
        )


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "dtensor"])
def test_synchronizer_overlap_unused_params_and_errors(plain: bool) -> None:
    run_distributed(_sync_behaviour, 2, plain, timeout=120)
