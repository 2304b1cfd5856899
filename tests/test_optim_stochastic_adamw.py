from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from d9d.optim import StochasticAdamW
from tests.harness import RankEnv, run_distributed


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny tensors: extra threads only contend on a shared CI machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _grads(shape: tuple[int, ...], steps: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(steps)]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_step_matches_torch_adamw_in_expectation(state_dtype: torch.dtype) -> None:
    rows, cols, steps = 4096, 48, 4
    generator = torch.Generator().manual_seed(0)
    magnitude = torch.rand(cols, generator=generator) * 1.5 + 0.5
    start = (magnitude * torch.randn(cols, generator=generator).sign()).bfloat16()
    grads = _grads((cols,), steps, seed=1)
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

    reference = nn.Parameter(start.float())  # fp32 master weights
    torch_adamw = torch.optim.AdamW([reference], **hyper)  # type: ignore[arg-type]
    # Every row holds the same value and gets the same gradient: rows are independent rounding trials.
    param = nn.Parameter(start.expand(rows, cols).clone())
    ours = StochasticAdamW([param], **hyper, state_dtype=state_dtype, seed=5)  # type: ignore[arg-type]
    for grad in grads:
        g = grad.bfloat16()  # bf16 gradients, identical on both sides
        reference.grad = g.float()
        param.grad = g.expand(rows, cols).clone()
        torch_adamw.step()
        ours.step()

    values = param.detach().double()
    mean, std = values.mean(dim=0), values.std(dim=0)
    expected = reference.detach().double()
    tolerance = 5 * std / rows**0.5 + 1e-6 * expected.abs()
    assert bool(((mean - expected).abs() <= tolerance).all()), ((mean - expected).abs() / tolerance).max()
    # The test has power: each update is below half a bf16 ulp, so round-to-nearest does not move the
    # weights at all, and that result fails the tolerance on most columns.
    nearest = nn.Parameter(start.float())
    nearest_adamw = torch.optim.AdamW([nearest], **hyper)  # type: ignore[arg-type]
    for grad in grads:
        nearest.grad = grad.bfloat16().float()
        nearest_adamw.step()
        nearest.data = nearest.data.bfloat16().float()
    assert torch.equal(nearest.detach(), start.float())
    assert float(((start.double() - expected).abs() > tolerance).double().mean()) > 0.8

    ref_state = torch_adamw.state[reference]
    state = ours.state[param]
    assert int(state["step"]) == steps
    for key in ("exp_avg", "exp_avg_sq"):
        assert state[key].dtype == state_dtype
        if state_dtype == torch.float32:
            torch.testing.assert_close(state[key], ref_state[key].expand(rows, cols), rtol=1e-5, atol=1e-12)
        else:
            m = state[key].double()
            spread = 5 * m.std(dim=0) / rows**0.5 + 1e-7 * ref_state[key].double().abs()
            assert bool(((m.mean(dim=0) - ref_state[key].double()).abs() <= spread).all()), key


def test_fp32_params_take_the_exact_update() -> None:
    generator = torch.Generator().manual_seed(3)
    start = torch.randn(10, 7, generator=generator)
    grads = _grads((10, 7), 3, seed=4)
    reference = nn.Parameter(start.clone())
    torch_adamw = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.05)
    param = nn.Parameter(start.clone())
    ours = StochasticAdamW([param], lr=1e-2, weight_decay=0.05)
    for grad in grads:
        reference.grad, param.grad = grad.clone(), grad.clone()
        torch_adamw.step()
        ours.step()
    torch.testing.assert_close(param.detach(), reference.detach(), rtol=1e-6, atol=1e-7)


def _params(seed: int) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        nn.Parameter(torch.randn(33, 5, generator=generator).bfloat16()),
        nn.Parameter(torch.randn(17, generator=generator)),
        nn.Parameter(torch.randn(4, 3, generator=generator).bfloat16().t()),  # non-contiguous
    ]


def _run(params: list[nn.Parameter], optimizer: StochasticAdamW, steps: range) -> None:
    for step in steps:
        for i, p in enumerate(params):
            p.grad = _grads(tuple(p.shape), 1, seed=1000 * step + i)[0].to(p.dtype)
        optimizer.step()


def _bits(params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [
        p.detach().clone().view(torch.int16 if p.dtype == torch.bfloat16 else torch.int32) for p in params
    ]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_resume_reproduces_bitwise(state_dtype: torch.dtype) -> None:
    straight = _params(0)
    straight_opt = StochasticAdamW(straight, lr=3e-3, state_dtype=state_dtype, seed=11)
    _run(straight, straight_opt, range(6))

    first = _params(0)
    first_opt = StochasticAdamW(first, lr=3e-3, state_dtype=state_dtype, seed=11)
    _run(first, first_opt, range(3))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "optim": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed = [nn.Parameter(t.clone()) for t in saved["params"]]
    resumed_opt = StochasticAdamW(
        resumed, lr=3e-3, state_dtype=state_dtype, seed=999
    )  # seed comes from state
    resumed_opt.load_state_dict(saved["optim"])
    assert resumed_opt.state[resumed[0]]["exp_avg"].dtype == state_dtype  # not cast to the param dtype
    _run(resumed, resumed_opt, range(3, 6))
    for a, b in zip(_bits(straight), _bits(resumed), strict=True):
        assert torch.equal(a, b)

    # Without the saved state (fresh moments and counter) the run diverges: the comparison has teeth.
    fresh = [nn.Parameter(t.clone()) for t in saved["params"]]
    _run(fresh, StochasticAdamW(fresh, lr=3e-3, state_dtype=state_dtype, seed=11), range(3, 6))
    assert not torch.equal(_bits(straight)[0], _bits(fresh)[0])


def test_seed_changes_rounding_but_not_the_moments() -> None:
    a, b = _params(0), _params(0)
    opt_a = StochasticAdamW(a, lr=3e-3, seed=1)
    opt_b = StochasticAdamW(b, lr=3e-3, seed=2)
    _run(a, opt_a, range(2))
    _run(b, opt_b, range(2))
    assert not torch.equal(_bits(a)[0], _bits(b)[0])
    assert (a[0].float() - b[0].float()).abs().max() <= 2 * a[0].float().abs().max() * 2**-7
    assert torch.equal(opt_a.state[a[0]]["exp_avg"], opt_b.state[b[0]]["exp_avg"])
    assert torch.equal(_bits(a)[1], _bits(b)[1])  # fp32 params are not rounded


def test_invalid_arguments_are_named() -> None:
    p = [nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match=r"betas\[1\]=1.0"):
        StochasticAdamW(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"state_dtype=torch\.float16"):
        StochasticAdamW(p, state_dtype=torch.float16)
    with pytest.raises(ValueError, match="seed=-3"):
        StochasticAdamW(p, seed=-3)
    with pytest.raises(ValueError, match="backend='cuda'"):
        StochasticAdamW(p, backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"param_groups\[1\]\.params\[0\] has dtype torch\.float16"):
        StochasticAdamW([{"params": p}, {"params": [nn.Parameter(torch.zeros(2, dtype=torch.float16))]}])


# --- distributed: DTensor shards and replicas --------------------------------------------------------


def _dtensor_body(env: RankEnv) -> None:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (env.world_size,))
    generator = torch.Generator().manual_seed(0)
    # 9 rows over 2 ranks: an uneven Shard(0) (5 + 4 rows) still numbers elements globally. The Shard(1)
    # tensor repeats its left half on the right, so both column shards see identical data.
    half = [torch.randn(9, 3, generator=generator) for _ in range(4)]
    fulls = [torch.randn(9, 6, generator=generator).bfloat16() for _ in range(2)]
    fulls.append(torch.cat([half[0], half[0]], dim=1).bfloat16())
    grads = [
        [torch.randn(9, 6, generator=generator).bfloat16() for _ in range(2)]
        + [torch.cat([half[step + 1], half[step + 1]], dim=1).bfloat16()]
        for step in range(3)
    ]
    placements = [[Shard(0)], [Replicate()], [Shard(1)]]

    dparams = [
        nn.Parameter(distribute_tensor(f.clone(), mesh, pl)) for f, pl in zip(fulls, placements, strict=True)
    ]
    local = [nn.Parameter(f.clone()) for f in fulls]
    dist_opt = StochasticAdamW(dparams, lr=3e-3, seed=77)
    local_opt = StochasticAdamW(local, lr=3e-3, seed=77)
    for step in range(3):
        for i in range(3):
            dparams[i].grad = distribute_tensor(grads[step][i].clone(), mesh, placements[i])
            local[i].grad = grads[step][i].clone()
        dist_opt.step()
        local_opt.step()

    gathered = [p.detach().full_tensor().view(torch.int16) for p in dparams]
    unsharded = [p.detach().view(torch.int16) for p in local]
    # Dim-0 shards and replicas round exactly like the unsharded tensor, so replicas also agree.
    assert torch.equal(gathered[0], unsharded[0])
    assert torch.equal(gathered[1], unsharded[1])
    replicas = [torch.empty_like(dparams[1].to_local()) for _ in range(env.world_size)]
    dist.all_gather(replicas, dparams[1].to_local().contiguous())
    assert all(torch.equal(r, replicas[0]) for r in replicas)
    for i in range(3):
        exp_avg = dist_opt.state[dparams[i]]["exp_avg"]
        assert isinstance(exp_avg, DTensor)
        assert tuple(exp_avg.placements) == tuple(placements[i])
        assert torch.equal(exp_avg.full_tensor(), local_opt.state[local[i]]["exp_avg"])
    # Column shards cannot be numbered globally: each draws its own stream, so identical shard data
    # rounds differently on the two ranks, while staying within a few ulps of the unsharded run.
    left, right = gathered[2][:, :3], gathered[2][:, 3:]
    assert not torch.equal(left, right)
    assert int((left.int() - right.int()).abs().max()) <= 3
    dparams[0].grad = distribute_tensor(grads[0][0].clone(), mesh, [Replicate()])
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\.params\[0\]: grad placements"):
        dist_opt.step()


@pytest.mark.distributed
def test_dtensor_shards_round_like_the_full_tensor() -> None:
    run_distributed(_dtensor_body, 2, timeout=120)


def test_dcp_flattened_state_dict_resumes_bitwise() -> None:
    # The engine checkpoints optimizers through DCP's flattened state dict (`state.<fqn>.exp_avg`,
    # `param_groups.<fqn>.seed`): the rounding stream must survive that path too.
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).bfloat16()

    def train(m: nn.Module, optimizer: StochasticAdamW, steps: range) -> None:
        for step in steps:
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step)).bfloat16()
            optimizer.zero_grad()
            m(x).float().pow(2).mean().backward()
            optimizer.step()

    straight = model()
    train(straight, StochasticAdamW(straight.parameters(), lr=1e-3, seed=3), range(6))
    first = model()
    first_opt = StochasticAdamW(first.parameters(), lr=1e-3, seed=3)
    train(first, first_opt, range(3))
    saved = get_optimizer_state_dict(first, first_opt, options=options)
    assert saved["param_groups.0.weight.seed"] == 3
    assert saved["state.0.weight.exp_avg"].dtype == torch.float32

    resumed = model()
    resumed.load_state_dict(first.state_dict())
    resumed_opt = StochasticAdamW(resumed.parameters(), lr=1e-3, seed=99)
    set_optimizer_state_dict(resumed, resumed_opt, saved, options=options)
    train(resumed, resumed_opt, range(3, 6))
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bf16_training_with_stochastic_rounding_tracks_fp32_master_weights() -> None:
    """Fine-tune a perturbed 2-layer MLP back toward its teacher at a small LR (numbers in docs/optim.md)."""
    d_in, hidden, d_out, samples, steps, lr = 32, 64, 4, 2048, 500, 5e-4
    generator = torch.Generator().manual_seed(1)
    teacher = [
        torch.randn(d_in, hidden, generator=generator),
        torch.randn(hidden, d_out, generator=generator),
    ]
    x = torch.randn(samples, d_in, generator=generator) / d_in**0.5

    def forward(weights: list[torch.Tensor]) -> torch.Tensor:
        w1, w2 = (w.float() for w in weights)
        return torch.tanh(x @ w1) @ w2 / hidden**0.5

    y = forward(teacher) + 0.1 * torch.randn(samples, d_out, generator=generator)
    start = [w + 0.2 * torch.randn(w.shape, generator=generator) for w in teacher]

    def train(kind: str) -> float:
        # "nearest" keeps bf16 values in fp32 storage and rounds them back after each torch AdamW step.
        storage = {"fp32": torch.float32, "stochastic": torch.bfloat16, "nearest": torch.float32}[kind]
        values = start if kind == "fp32" else [w.bfloat16() for w in start]
        weights = [nn.Parameter(w.to(storage, copy=True)) for w in values]
        if kind == "stochastic":
            optimizer: torch.optim.Optimizer = StochasticAdamW(weights, lr=lr, weight_decay=0.0, seed=3)
        else:
            optimizer = torch.optim.AdamW(weights, lr=lr, weight_decay=0.0)
        for _ in range(steps):
            optimizer.zero_grad()
            ((forward(weights) - y) ** 2).mean().backward()  # type: ignore[arg-type]
            optimizer.step()
            if kind == "nearest":
                with torch.no_grad():
                    for w in weights:
                        w.copy_(w.bfloat16().float())
        with torch.no_grad():
            return float(((forward(weights) - y) ** 2).mean())  # type: ignore[arg-type]

    with torch.no_grad():
        initial = float(((forward(start) - y) ** 2).mean())
    fp32, stochastic, nearest = train("fp32"), train("stochastic"), train("nearest")
    print(
        f"initial {initial:.5f} fp32 {fp32:.5f} bf16+stochastic {stochastic:.5f} bf16+nearest {nearest:.5f}"
    )
    assert fp32 < initial / 3
    assert abs(stochastic - fp32) <= 0.02 * fp32
    assert nearest > 1.5 * fp32  # round-to-nearest stalls: most updates are below half an ulp


@pytest.mark.gpu
def test_cuda_optimizer_uses_the_kernel_and_matches_the_cpu_run() -> None:
    from d9d.kernels.stochastic_rounding import resolve_backend

    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    cpu = _params(0)
    cuda = [nn.Parameter(p.detach().cuda()) for p in cpu]
    cpu_opt = StochasticAdamW(cpu, lr=3e-3, state_dtype=torch.bfloat16, seed=5)
    cuda_opt = StochasticAdamW(cuda, lr=3e-3, state_dtype=torch.bfloat16, seed=5)
    for step in range(4):
        for i, (a, b) in enumerate(zip(cpu, cuda, strict=True)):
            a.grad = _grads(tuple(a.shape), 1, seed=1000 * step + i)[0].to(a.dtype)
            b.grad = a.grad.cuda()
        cpu_opt.step()
        cuda_opt.step()
    # Same random bits on both devices; only fp32 rounding differences (FMA) may flip a rounding.
    for a, b in zip(cpu, cuda, strict=True):
        if a.dtype == torch.float32:
            torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-6, atol=1e-7)
            continue
        ulps = (a.detach().view(torch.int16).int() - b.detach().cpu().view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 2
        assert float((ulps > 0).double().mean()) < 0.02
