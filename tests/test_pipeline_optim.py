"""PipelinedOptimizer / PipelinedLRScheduler against one optimizer and scheduler over the same parameters."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from d9d.pipeline.optim import PipelinedLRScheduler, PipelinedOptimizer, _sharded_alike
from tests.harness import RankEnv, run_distributed


def _stages() -> dict[int, nn.Module]:
    torch.manual_seed(0)
    frozen = nn.Linear(2, 2)
    frozen.requires_grad_(False)
    return {1: nn.Linear(4, 3), 5: nn.Sequential(nn.Linear(3, 2), frozen)}


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def _loss(stages: dict[int, nn.Module], x: torch.Tensor) -> torch.Tensor:
    return stages[5](stages[1](x)).pow(2).sum()


def _train(stages: dict[int, nn.Module], opt: object, sched: object, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()  # type: ignore[attr-defined]
        _loss(stages, torch.randn(5, 4, generator=g)).backward()
        opt.step()  # type: ignore[attr-defined]
        sched.step()  # type: ignore[attr-defined]


def test_steps_like_one_optimizer_over_all_stages() -> None:
    piped, single = _stages(), _stages()
    opt = PipelinedOptimizer.build(piped, lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1))
    sched = PipelinedLRScheduler.build(opt, lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup))
    ref_params = [p for m in single.values() for p in m.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(ref_params, lr=0.1, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _warmup)
    _train(piped, opt, sched, 4, seed=1)
    _train(single, ref_opt, ref_sched, 4, seed=1)
    for s in piped:
        for (name, p), q in zip(piped[s].named_parameters(), single[s].parameters(), strict=True):
            torch.testing.assert_close(p, q, msg=f"stage {s} {name}")
    assert sched.get_last_lr() == pytest.approx([ref_sched.get_last_lr()[0]] * 2)
    assert len(opt.param_groups) == 2
    opt.param_groups[1]["lr"] = 0.5
    assert opt.optimizers[5].param_groups[0]["lr"] == 0.5


def test_state_round_trip_resumes_exactly() -> None:
    def make(stages: dict[int, nn.Module]) -> tuple[PipelinedOptimizer, PipelinedLRScheduler]:
        opt = PipelinedOptimizer.build(stages, lambda ps: torch.optim.AdamW(ps, lr=0.05))
        return opt, PipelinedLRScheduler.build(opt, lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup))

    stages = _stages()
    opt, sched = make(stages)
    _train(stages, opt, sched, 2, seed=3)
    saved = (copy.deepcopy(stages), copy.deepcopy(opt.state_dict()), sched.state_dict())
    _train(stages, opt, sched, 2, seed=4)

    resumed = saved[0]
    opt2, sched2 = make(resumed)
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    _train(resumed, opt2, sched2, 2, seed=4)
    for s in stages:
        for p, q in zip(stages[s].parameters(), resumed[s].parameters(), strict=True):
            torch.testing.assert_close(p, q)


def test_state_of_other_stages_is_refused() -> None:
    opt = PipelinedOptimizer.build(_stages(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    state = opt.state_dict()
    state["2"] = state.pop("5")
    with pytest.raises(ValueError, match=r"optimizer state is for stages \['1', '2'\], but this rank holds"):
        opt.load_state_dict(state)


def test_pairing_stages_with_optimizers_checks_the_stage_sets() -> None:
    stages = _stages()
    opt = PipelinedOptimizer({s: torch.optim.SGD(m.parameters(), lr=0.1) for s, m in stages.items()})
    assert [m for m, _ in opt.pair_with(stages)] == [stages[1], stages[5]]
    with pytest.raises(
        ValueError, match=r"modules: stages \[1\] do not match the optimizer's stages \[1, 5\]"
    ):
        opt.pair_with({1: stages[1]})
    with pytest.raises(ValueError, match=r"stages \[1, 2, 5\] do not match"):
        opt.pair_with({**stages, 2: nn.Linear(1, 1)})


def test_schedulers_must_match_the_optimizers_stages() -> None:
    opt = PipelinedOptimizer.build(_stages(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    only_first = {1: torch.optim.lr_scheduler.LambdaLR(opt.optimizers[1], _warmup)}
    with pytest.raises(ValueError, match=r"LR schedulers: stages \[1\] do not match the optimizer's stages"):
        PipelinedLRScheduler(only_first, opt)
    swapped = {
        1: torch.optim.lr_scheduler.LambdaLR(opt.optimizers[5], _warmup),
        5: torch.optim.lr_scheduler.LambdaLR(opt.optimizers[1], _warmup),
    }
    with pytest.raises(ValueError, match="scheduler of stage 1 drives another optimizer"):
        PipelinedLRScheduler(swapped, opt)


def test_positional_scheduler_state_restores_another_stage_count_only_from_one_schedule() -> None:
    """A resume that changes the stages per rank (1F1B's one stage → ZBV's two): the saved stages all
    followed one schedule, so that position restores every stage; states that disagree are refused."""
    opt = PipelinedOptimizer.build(_stages(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    sched = PipelinedLRScheduler.build(opt, lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup))
    opt.step()
    sched.step()
    state = sched.positional_state()
    assert [s["last_epoch"] for s in state] == [1, 1]
    fresh_opt = PipelinedOptimizer.build(_stages(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    fresh = PipelinedLRScheduler.build(fresh_opt, lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup))
    fresh.load_positional_state(state[:1])
    assert fresh.positional_state() == state
    assert fresh.get_last_lr() == sched.get_last_lr()  # (the groups' own LRs come with the optimizer state)
    disagreeing = [state[0], {**state[1], "last_epoch": 2}, state[1]]
    with pytest.raises(ValueError, match="holds 3 LR scheduler states, this rank has 2"):
        fresh.load_positional_state(disagreeing)
    with pytest.raises(ValueError, match="holds 0 LR scheduler states, this rank has 2"):
        fresh.load_positional_state([])


def test_live_lr_change_keeps_the_schedules_position() -> None:
    """set_base_lr scales the current LR by new/old peak (mid-warmup stays mid-warmup); set_lr without a
    scheduler sets every group."""
    opt = PipelinedOptimizer.build(_stages(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    sched = PipelinedLRScheduler.build(opt, lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup))
    opt.step()
    sched.step()  # warmup at 2/3
    sched.set_base_lr(0.3)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.3 * 2 / 3] * 2)
    opt.step()
    sched.step()  # warmup done: the new peak
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.3, 0.3])
    assert opt.lr == pytest.approx(0.3)
    opt.set_lr(0.01)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.01]


def _snapshot(stages: dict[int, nn.Module], opt: PipelinedOptimizer) -> list[torch.Tensor]:
    params = [p.detach().clone() for m in stages.values() for p in m.parameters()]
    states = [
        v.clone()
        for o in opt.optimizers.values()
        for s in o.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    ]
    return params + states


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_a_device_side_skip_changes_nothing_and_a_pass_equals_a_plain_step(kind: type) -> None:
    """`step(skip_if=1.0)` leaves parameters, moments and step counts bitwise as they were (the fused kernels'
    `found_inf`); `skip_if=0.0` is bitwise the plain step. Only fused Adam/AdamW with state qualifies."""
    stages, twin = _stages(), _stages()
    opt = PipelinedOptimizer.build(stages, lambda ps: kind(ps, lr=0.1, fused=True))
    twin_opt = PipelinedOptimizer.build(twin, lambda ps: kind(ps, lr=0.1, fused=True))
    assert not opt.skips_on_device  # no state before the first step: the host decides
    _train(stages, opt, _NoSchedule(), 2, seed=3)
    _train(twin, twin_opt, _NoSchedule(), 2, seed=3)
    assert opt.skips_on_device
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    for o, s in ((opt, stages), (twin_opt, twin)):
        o.zero_grad()
        _loss(s, x).backward()
    before = _snapshot(stages, opt)
    opt.step(skip_if=torch.tensor(1.0))
    after = _snapshot(stages, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    opt.step(skip_if=torch.tensor(0.0))
    twin_opt.step()
    assert all(
        torch.equal(a, b) for a, b in zip(_snapshot(stages, opt), _snapshot(twin, twin_opt), strict=True)
    )
    assert not hasattr(opt.optimizers[1], "found_inf")  # a later plain step sees no stale flag


def test_only_fused_adam_skips_on_the_device() -> None:
    for build in (
        lambda ps: torch.optim.AdamW(ps, lr=0.1),  # foreach
        lambda ps: torch.optim.SGD(ps, lr=0.1),
    ):
        stages = _stages()
        opt = PipelinedOptimizer.build(stages, build)
        _train(stages, opt, _NoSchedule(), 1, seed=3)
        assert not opt.skips_on_device
        with pytest.raises(RuntimeError, match="skips_on_device"):
            opt.step(skip_if=torch.tensor(0.0))


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW])
def test_a_grad_divisor_equals_stepping_on_divided_gradients(kind: type) -> None:
    """`step(grad_divisor=d)` on gradients g updates like a plain step on g / d (float32: equal up to the
    division's rounding), on the first step (state created) and later ones, and leaves g / d in `.grad`."""
    stages, twin = _stages(), _stages()
    opt = PipelinedOptimizer.build(stages, lambda ps: kind(ps, lr=0.1, weight_decay=0.01, fused=True))
    twin_opt = PipelinedOptimizer.build(twin, lambda ps: kind(ps, lr=0.1, weight_decay=0.01, fused=True))
    assert opt.divides_gradients
    divisor = torch.tensor(37.0, dtype=torch.float64)
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 + step))
        for o, s in ((opt, stages), (twin_opt, twin)):
            o.zero_grad()
            _loss(s, x).backward()
        for p in (p for m in twin.values() for p in m.parameters() if p.grad is not None):
            p.grad.div_(37.0)
        opt.step(grad_divisor=divisor)
        twin_opt.step()
        for a, b in zip(_snapshot(stages, opt), _snapshot(twin, twin_opt), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for p, q in zip(
            (p for m in stages.values() for p in m.parameters()),
            (q for m in twin.values() for q in m.parameters()),
            strict=True,
        ):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    assert not hasattr(opt.optimizers[1], "grad_scale")  # a later plain step divides by nothing


def test_only_fused_adam_divides_gradients() -> None:
    stages = _stages()
    opt = PipelinedOptimizer.build(stages, lambda ps: torch.optim.AdamW(ps, lr=0.1))  # foreach
    assert not opt.divides_gradients
    with pytest.raises(RuntimeError, match="divides_gradients"):
        opt.step(grad_divisor=torch.tensor(2.0))


class _NoSchedule:
    def step(self) -> None:
        pass


def _sharded_twins(env: RankEnv, amsgrad: bool) -> None:
    """Rank body: two copies of a model sharded by FSDP2 over 2 ranks (one layer on its own unit, a frozen
    one), fused AdamW; one steps through `PipelinedOptimizer` (the local-shard update once the state exists),
    the other through `Adam.step` over the DTensors. Bitwise equal after every step: plain, divided,
    skipped, and after a learning-rate change."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (env.world_size,))

    def model() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3))
        m[2].requires_grad_(False)
        fully_shard(m[1], mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    def build(ps: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, amsgrad=amsgrad, fused=True)

    ours, theirs = model(), model()
    opt = PipelinedOptimizer.build({0: ours}, build)
    ref = build([p for p in theirs.parameters() if p.requires_grad])
    g = torch.Generator().manual_seed(env.rank)
    for step in range(6):
        x = torch.randn(4, 6, generator=g)
        opt.zero_grad()
        ref.zero_grad()
        ours(x).pow(2).sum().backward()
        theirs(x).pow(2).sum().backward()
        divisor = torch.tensor(3.0) if step >= 2 else None
        skip = torch.tensor(float(step == 4)) if step >= 1 else None
        if step == 5:
            opt.set_lr(0.01)
            for group in ref.param_groups:
                group["lr"] = 0.01
        if step >= 1:
            assert _sharded_alike(opt.optimizers[0])  # the local-shard update runs from here on
        opt.step(skip_if=skip, grad_divisor=divisor)
        ref.grad_scale = None if divisor is None else divisor  # type: ignore[attr-defined]
        ref.found_inf = skip  # type: ignore[attr-defined]
        ref.step()
        mine = [p.to_local() for p in ours.parameters()] + [
            v.to_local() if isinstance(v, DTensor) else v
            for s in opt.optimizers[0].state.values()
            for v in s.values()
        ]
        reference = [p.to_local() for p in theirs.parameters()] + [
            v.to_local() if isinstance(v, DTensor) else v for s in ref.state.values() for v in s.values()
        ]
        assert len(mine) == len(reference)
        for a, b in zip(mine, reference, strict=True):
            assert torch.equal(a, b), (step, a, b)
        # no flag left behind for a later step that goes through Adam.step
        assert not hasattr(opt.optimizers[0], "found_inf") and not hasattr(opt.optimizers[0], "grad_scale")
    # a gradient still to be summed (Partial) is not a shard: the update goes back to Adam.step
    p = next(p for p in ours.parameters() if p.requires_grad)
    assert isinstance(p.grad, DTensor)
    p.grad = DTensor.from_local(torch.zeros(p.shape), mesh, [Partial()])
    assert not _sharded_alike(opt.optimizers[0])


def _two_meshes(env: RankEnv) -> None:
    """Rank body: parameters on two meshes of a 2 × 2 layout, as FSDP × EP leaves them (dense weights
    sharded on one dim, experts sharded on the other, norms replicated), in one fused AdamW group: the
    local-shard update equals `Adam.step` over the DTensors bitwise."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    layouts = [(mesh["dp"], Shard(0)), (mesh["ep"], Shard(0)), (mesh["dp"], Replicate()), (mesh, None)]

    def params() -> list[nn.Parameter]:
        torch.manual_seed(0)
        out = []
        for i, (m, placement) in enumerate(layouts):
            placements = [Shard(0), Replicate()] if placement is None else [placement]
            out.append(nn.Parameter(distribute_tensor(torch.randn(4 + 2 * i, 3), m, placements)))
        return out

    ours, theirs = params(), params()
    opt = PipelinedOptimizer({0: torch.optim.AdamW(ours, lr=0.05, weight_decay=0.1, fused=True)})
    ref = torch.optim.AdamW(theirs, lr=0.05, weight_decay=0.1, fused=True)
    for step in range(4):
        torch.manual_seed(100 + step)  # the same gradients, each distributed like its parameter
        for a, b in zip(ours, theirs, strict=True):
            g = torch.randn(a.shape)
            a.grad = distribute_tensor(g, a.device_mesh, a.placements)
            b.grad = distribute_tensor(g.clone(), b.device_mesh, b.placements)
        if step >= 1:
            assert _sharded_alike(opt.optimizers[0])
        opt.step(grad_divisor=torch.tensor(2.0))
        ref.grad_scale = torch.tensor(2.0)  # type: ignore[attr-defined]
        ref.step()
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.to_local(), b.to_local()), (step, a.device_mesh)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.optimizers[0].state[a][key].to_local(), ref.state[b][key].to_local())


@pytest.mark.distributed
@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_adam_on_local_shards_is_bitwise_adam_step_over_dtensors(amsgrad: bool) -> None:
    run_distributed(_sharded_twins, 2, amsgrad, timeout=120)


@pytest.mark.distributed
def test_fused_adam_on_local_shards_over_two_meshes() -> None:
    run_distributed(_two_meshes, 4, timeout=120)


def test_plain_parameters_keep_adam_step() -> None:
    stages = _stages()
    opt = PipelinedOptimizer.build(stages, lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True))
    _train(stages, opt, _NoSchedule(), 1, seed=3)
    assert not _sharded_alike(opt.optimizers[1])  # no DTensor: no dispatch to skip
