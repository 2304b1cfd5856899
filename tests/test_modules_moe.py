from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from d9d.modules.checkpointing import checkpointed
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe import (
    GROUPED_MM_ENV,
    AutoGroupedMM,
    EagerGroupedMM,
    GroupedExperts,
    LocalMoECommunication,
    MoECommunication,
    MoELayer,
    MoEMetrics,
    RoutedTokens,
    TopKRouter,
    TorchGroupedMM,
    build_grouped_mm,
    expert_load_metrics,
    load_balancing_loss,
    route_topk,
)


def _torch_grouped_mm_works_on_cpu() -> bool:
    try:
        TorchGroupedMM()(torch.ones(2, 2), torch.ones(1, 2, 2), torch.tensor([2]))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def _backends_here() -> list[tuple[str, object]]:
    backends: list[tuple[str, object]] = [("auto", AutoGroupedMM())]
    if _torch_grouped_mm_works_on_cpu():
        backends.append(("torch", TorchGroupedMM()))
    return backends


def _grouped_mm_case(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 8], device=device)  # an empty group included
    x = torch.randn(16, 32, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(4, 32, 16, device=device, dtype=dtype, requires_grad=True)
    return x, weight, counts


def _check_against_eager(backend: object, device: str, dtype: torch.dtype, tol: float) -> None:
    x, weight, counts = _grouped_mm_case(device, dtype)
    grad_out = torch.randn(16, 16, device=device, dtype=dtype)
    out = backend(x, weight, counts)  # type: ignore[operator]
    (out * grad_out).sum().backward()
    got = (out.float(), x.grad.float(), weight.grad.float())  # type: ignore[union-attr]
    x32, w32 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = EagerGroupedMM()(x32, w32, counts)
    (ref * grad_out.float()).sum().backward()
    for a, b in zip(got, (ref, x32.grad, w32.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_eager_grouped_mm_is_a_per_expert_matmul() -> None:
    x, weight, counts = _grouped_mm_case("cpu", torch.float64)
    out = EagerGroupedMM()(x, weight, counts)
    torch.testing.assert_close(out[:3], x[:3] @ weight[0])
    torch.testing.assert_close(out[3:8], x[3:8] @ weight[2])
    torch.testing.assert_close(out[8:], x[8:] @ weight[3])


@pytest.mark.parametrize(("name", "backend"), _backends_here(), ids=lambda v: v if isinstance(v, str) else "")
def test_cpu_grouped_mm_backends_match_eager(name: str, backend: object) -> None:
    _check_against_eager(backend, "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
def test_torch_grouped_mm_on_cuda_matches_eager() -> None:
    _check_against_eager(TorchGroupedMM(), "cuda", torch.bfloat16, 2e-2)
    _check_against_eager(AutoGroupedMM(), "cuda", torch.bfloat16, 2e-2)


@pytest.mark.gpu
def test_grouped_gemm_on_cuda_matches_eager() -> None:
    pytest.importorskip("grouped_gemm")
    _check_against_eager(build_grouped_mm("grouped_gemm"), "cuda", torch.bfloat16, 2e-2)


def test_build_grouped_mm_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(build_grouped_mm("eager"), EagerGroupedMM)
    monkeypatch.setenv(GROUPED_MM_ENV, "eager")
    assert isinstance(build_grouped_mm(), EagerGroupedMM)
    monkeypatch.setenv(GROUPED_MM_ENV, "fast")
    with pytest.raises(ValueError, match="D9D_GROUPED_MM='fast'"):
        build_grouped_mm()
    monkeypatch.delenv(GROUPED_MM_ENV)
    assert isinstance(build_grouped_mm(), AutoGroupedMM)
    if importlib.util.find_spec("grouped_gemm") is None:
        with pytest.raises(ValueError, match="'grouped_gemm' requested but the package is not installed"):
            build_grouped_mm("grouped_gemm")


def _softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def test_router_against_hand_computed_values() -> None:
    router = TopKRouter(2, 3, 2, renormalize=False)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    x = torch.tensor([[2.0, -1.0], [0.5, 0.25]])
    routing = router(x)
    p0 = _softmax([2.0, -1.0, 1.0])  # expert logits for token 0
    p1 = _softmax([0.5, 0.25, 0.75])
    torch.testing.assert_close(routing.probs, torch.tensor([p0, p1]))
    assert routing.topk_ids.tolist() == [[0, 2], [2, 0]]
    torch.testing.assert_close(routing.topk_weights, torch.tensor([[p0[0], p0[2]], [p1[2], p1[0]]]))
    assert router.expert_load.tolist() == [2.0, 0.0, 2.0]

    router.renormalize = True
    renormed = router(x).topk_weights
    torch.testing.assert_close(renormed[0], torch.tensor([p0[0], p0[2]]) / (p0[0] + p0[2]))


def test_expert_bias_changes_selection_not_weights_and_updates_from_load() -> None:
    router = TopKRouter(2, 4, 1, renormalize=False, expert_bias=True, bias_update_rate=0.5)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [-1.0, 0.0]]))
    x = torch.tensor([[1.0, 0.1]] * 5 + [[0.0, 1.0]] + [[-1.0, -1.0]] * 6)
    first = router(x)
    # logits [1, .1, 0, -1] → expert 0 (5 tokens); [0, 1, 0, 0] → expert 1; [-1, -1, 0, 1] → expert 3 (6)
    assert router.expert_load.tolist() == [5.0, 1.0, 0.0, 6.0]
    router.update_expert_bias()
    assert router.expert_bias is not None
    # mean load 3: over-loaded experts 0 and 3 go down, 1 and 2 go up
    assert router.expert_bias.tolist() == [-0.5, 0.5, 0.5, -0.5]
    assert router.expert_load.tolist() == [0.0, 0.0, 0.0, 0.0]
    second = router(x)
    # token 0: probs softmax([1, .1, 0, -1]) ≈ [.52, .21, .19, .07] + bias → expert 1 wins the selection ...
    assert second.topk_ids[0].item() == 1
    # ... but its weight is the unbiased probability
    torch.testing.assert_close(second.topk_weights[0, 0], first.probs[0, 1])


def test_load_balancing_loss_hand_computed() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    # f = [0.5, 0.5, 0]; P = [0.4, 0.4, 0.2]; E · Σ f·P = 3 · 0.4
    torch.testing.assert_close(load_balancing_loss(probs, torch.tensor([[0], [1]])), torch.tensor(1.2))
    # top-2: copies 0,1 | 1,2 → f = [0.25, 0.5, 0.25]; 3 · (0.1 + 0.2 + 0.05)
    torch.testing.assert_close(load_balancing_loss(probs, torch.tensor([[0, 1], [1, 2]])), torch.tensor(1.05))
    uniform = torch.full((4, 4), 0.25)
    torch.testing.assert_close(
        load_balancing_loss(uniform, torch.tensor([[0], [1], [2], [3]])), torch.tensor(1.0)
    )


def _moe(hidden: int = 8, experts: int = 4, top_k: int = 2, **kwargs: object) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(
        TopKRouter(hidden, experts, top_k, renormalize=True, init_std=0.5),
        GroupedExperts(experts, hidden, 6, grouped_mm=EagerGroupedMM(), init_std=0.3),
        **kwargs,  # type: ignore[arg-type]
    )


def _reference_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """float64, token by token: Σ_k w_k · SwiGLU_{e_k}(x)."""
    flat = x.reshape(-1, x.shape[-1]).double()
    probs = torch.softmax(flat @ layer.gate.weight.double().t(), -1)
    out = torch.zeros_like(flat)
    e = layer.experts
    for t in range(flat.shape[0]):
        top = torch.topk(probs[t], layer.gate.top_k)
        weights = top.values / top.values.sum()
        for w, i in zip(weights, top.indices, strict=True):
            h = flat[t]
            gate, up = e.gate_up_proj[i].double().chunk(2, dim=-1)
            act = torch.nn.functional.silu(h @ gate) * (h @ up)
            out[t] += w * (act @ e.down_proj[i].double())
    return out.view(x.shape)


def test_moe_layer_matches_token_by_token_reference_and_counts_exactly() -> None:
    layer = _moe()
    x = torch.randn(2, 5, 8)
    out = layer(x)
    torch.testing.assert_close(out.double(), _reference_moe(layer, x), rtol=1e-5, atol=1e-6)
    probs = torch.softmax(x.reshape(-1, 8) @ layer.gate.weight.t(), -1)
    expected_counts = torch.bincount(torch.topk(probs, 2).indices.flatten(), minlength=4)
    assert torch.equal(layer.gate.expert_load, expected_counts)
    assert layer.gate.expert_load.sum().item() == 20


def test_fused_gate_up_experts_match_separate_projections_in_float64() -> None:
    """`gate_up_proj` is gate (first `intermediate` output columns) then up: the module computes SwiGLU
    experts with separate gate / up / down weights, and its weight gradient splits into theirs."""
    num_experts, hidden, inter = 3, 8, 6
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts, hidden, inter, grouped_mm=EagerGroupedMM(), init_std=0.3).double()
    assert experts.gate_up_proj.shape == (num_experts, hidden, 2 * inter)
    assert experts.down_proj.shape == (num_experts, inter, hidden)
    assert experts.extra_repr() == "experts=3, hidden=8, intermediate=6"
    weights = {
        "gate": experts.gate_up_proj[..., :inter],
        "up": experts.gate_up_proj[..., inter:],
        "down": experts.down_proj,
    }
    ref = {k: w.detach().clone().requires_grad_() for k, w in weights.items()}
    counts = torch.tensor([3, 0, 4])  # an expert without tokens too
    x = torch.randn(7, hidden, dtype=torch.float64)
    dy = torch.randn(7, hidden, dtype=torch.float64)
    x_ref, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()

    rows = [
        (torch.nn.functional.silu(chunk @ ref["gate"][e]) * (chunk @ ref["up"][e])) @ ref["down"][e]
        for e, chunk in enumerate(x_ref.split(counts.tolist()))
    ]
    expected = torch.cat(rows)
    (expected * dy).sum().backward()
    out = experts(x_fused, counts)
    (out * dy).sum().backward()

    tight = {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(out, expected, **tight)
    torch.testing.assert_close(x_fused.grad, x_ref.grad, **tight)
    grad = experts.gate_up_proj.grad
    assert grad is not None and experts.down_proj.grad is not None
    torch.testing.assert_close(grad[..., :inter], ref["gate"].grad, **tight)
    torch.testing.assert_close(grad[..., inter:], ref["up"].grad, **tight)
    torch.testing.assert_close(experts.down_proj.grad, ref["down"].grad, **tight)


@pytest.mark.parametrize("align", [1, 4])
def test_local_communication_satisfies_contract(align: int) -> None:
    comm = LocalMoECommunication(align=align)
    assert isinstance(comm, MoECommunication)
    hidden = torch.arange(1, 4, dtype=torch.float32)[:, None].expand(3, 2)
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5]])
    d = comm.dispatch(RoutedTokens(hidden, ids, weights, 4))
    # grouped by expert, token order inside; with align, each group padded with zero rows to a multiple
    groups = [[1, 2], [2, 3], [1, 3], []]
    counts = [len(g) if align == 1 else align for g in groups]
    counts[-1] += d.hidden_states.shape[0] - sum(counts)  # the fixed-size buffer's slack goes last
    assert d.tokens_per_expert.tolist() == counts
    for group, rows in zip(groups, d.hidden_states[:, 0].split(counts), strict=True):
        assert rows.tolist() == group + [0] * (len(rows) - len(group))
    # combine weights each token's rows: here every expert is the identity plus its index
    expert_of_row = torch.repeat_interleave(torch.arange(4), d.tokens_per_expert)
    combined = comm.combine(d.hidden_states + expert_of_row[:, None], d)
    torch.testing.assert_close(
        combined, hidden * weights.sum(1, keepdim=True) + (weights * ids)[:, :, None].sum(1)
    )


def test_aux_loss_gradient_is_injected_with_coefficient() -> None:
    x = torch.randn(3, 4, 8)
    grad_out = torch.randn(3, 4, 8)
    with_aux = _moe(aux_loss_coef=0.25)
    (with_aux(x) * grad_out).sum().backward()
    assert with_aux.last_aux_loss is not None

    plain = _moe()
    out = plain(x)
    routing = plain.gate(x.reshape(-1, 8))
    explicit = (out * grad_out).sum() + 0.25 * load_balancing_loss(routing.probs, routing.topk_ids)
    explicit.backward()
    torch.testing.assert_close(with_aux.last_aux_loss, load_balancing_loss(routing.probs, routing.topk_ids))
    for (name, a), (_, b) in zip(with_aux.named_parameters(), plain.named_parameters(), strict=True):
        assert a.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_checkpointed_layer_counts_tokens_once() -> None:
    x = torch.randn(2, 6, 8, requires_grad=True)
    plain, ckpt = _moe(), _moe()
    plain(x).sum().backward()
    plain_grad = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    checkpointed(ckpt, x).sum().backward()
    assert torch.equal(ckpt.gate.expert_load, plain.gate.expert_load)
    torch.testing.assert_close(x.grad, plain_grad)


def test_gated_shared_expert() -> None:
    torch.manual_seed(1)
    shared = SwiGLU(8, 5, init_std=0.3)
    layer = _moe(shared_expert=shared, shared_expert_gate=True)
    routed_only = _moe()
    routed_only.load_state_dict(layer.state_dict(), strict=False)
    x = torch.randn(4, 8)
    gate = torch.sigmoid(x @ layer.shared_expert_gate.weight.t())  # type: ignore[union-attr]
    torch.testing.assert_close(layer(x), routed_only(x) + gate * shared(x))
    with pytest.raises(ValueError, match="shared_expert_gate=True needs a shared_expert"):
        _moe(shared_expert_gate=True)


def test_expert_load_metrics_hand_computed() -> None:
    load = torch.tensor([2, 6, 0, 4, 8], dtype=torch.int64)  # mean 4
    m = expert_load_metrics("l0", load)
    assert m["moe/l0/max_load_ratio"] == 2.0 and m["moe/l0/min_load_ratio"] == 0.0
    assert m["moe/l0/load_q50"] == 1.0  # the median expert (4 tokens) carries the mean
    assert m["moe/l0/load_q10"] == pytest.approx(0.2)  # linear interpolation between 0 and 0.5
    assert m["moe/l0/load_q90"] == pytest.approx(1.8)
    assert not any("/tokens/" in k for k in m)
    hist = expert_load_metrics("l0", load, histogram=True)
    assert [hist[f"moe/l0/tokens/e{e}"] for e in range(5)] == [2.0, 6.0, 0.0, 4.0, 8.0]
    assert expert_load_metrics("l0", torch.zeros(5, dtype=torch.int64)) == {}


def test_moe_metrics_record_aux_loss_and_drop_stale_histograms() -> None:
    model = torch.nn.ModuleDict({"a": _moe(), "b": _moe()})
    metrics = MoEMetrics([model], histogram_period=2)
    x = torch.randn(6, 8)
    expected = []
    for name in ("a", "b"):
        layer = model[name]
        assert isinstance(layer, MoELayer)
        losses = []
        for xi in (x, x * 2):
            layer(xi).sum().backward()
            assert layer.last_aux_loss is not None
            losses.append(float(layer.last_aux_loss))
        expected.append(sum(losses) / 2)
    values: dict[str, float] = {"loss": 1.0}
    loads = {"a": torch.tensor([1, 2, 3, 4]), "b": torch.tensor([4, 4, 4, 4])}
    metrics.record(values, loads, step=2)
    assert values["moe/a/aux_loss"] == pytest.approx(expected[0])
    assert values["moe/aux_loss"] == pytest.approx(sum(expected) / 2)
    assert values["moe/b/max_load_ratio"] == 1.0 and values["moe/a/tokens/e3"] == 4.0
    metrics.record(values, loads, step=3)  # no forward since: no aux loss; no histogram this step
    assert "moe/a/aux_loss" in values  # the previous value stays until the next forward ...
    assert not any("/tokens/" in k for k in values)  # ... but a histogram is never reported stale
    assert values["loss"] == 1.0


def test_sigmoid_routing_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 3.0, 1.0]])
    s = torch.sigmoid(logits)
    routing = route_topk(logits, 2, score_function="sigmoid", renormalize=True)
    assert routing.topk_ids.tolist() == [[0, 2], [1, 2]]
    torch.testing.assert_close(routing.topk_weights[0], s[0, [0, 2]] / s[0, [0, 2]].sum())
    torch.testing.assert_close(routing.probs, s / s.sum(1, keepdim=True))  # what the balancing loss reads
    # the bias moves the selection (expert 1 for token 0), the weights stay the unbiased scores
    biased = route_topk(
        logits, 2, score_function="sigmoid", renormalize=False, expert_bias=torch.tensor([0.0, 1.0, 0.0])
    )
    assert biased.topk_ids[0].tolist() == [1, 0]
    torch.testing.assert_close(biased.topk_weights[0], s[0, [1, 0]])


def test_expert_bias_stays_float32_in_a_bfloat16_model() -> None:
    router = TopKRouter(4, 4, 1, expert_bias=True, bias_update_rate=1e-3).to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias is not None
    assert router.expert_bias.dtype == torch.float32 and router.expert_load.dtype == torch.int64
    with torch.no_grad():
        router.expert_bias.fill_(0.5)  # a bf16 bias would round a 1e-3 step away here
    router.expert_load.copy_(torch.tensor([0, 4, 4, 4]))
    router.update_expert_bias()
    torch.testing.assert_close(router.expert_bias, torch.tensor([0.501, 0.499, 0.499, 0.499]))
    assert "expert_bias" in router.state_dict()


def test_balancer_defers_the_metrics_to_the_steps_that_log_them() -> None:
    """The expert loads go to the host without a wait at each optimizer step; the metrics are computed
    when the reporter reads them, from the newest step (an unread step's values are replaced, not mixed)."""
    from types import SimpleNamespace

    from d9d.engine.builtin.models import ExpertLoadBalancer
    from d9d.engine.step_metrics import StepMetrics

    model = torch.nn.ModuleDict({"a": _moe(), "b": _moe()})
    routers = [(f"{n}.gate", model[n].gate) for n in ("a", "b")]
    metrics = StepMetrics()
    metrics["loss"] = 1.0
    balancer = ExpertLoadBalancer(
        routers, SimpleNamespace(is_distributed=False), metrics, MoEMetrics([model])
    )
    per_step: list[dict[str, torch.Tensor]] = []
    for step in (5, 6):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        for name in ("a", "b"):
            model[name](x).sum().backward()
        per_step.append({n: r.expert_load.clone() for n, r in routers})
        balancer.after_optimizer_step(step)
        assert set(metrics) == {"loss"}  # nothing read yet
    metrics.resolve()
    want = expert_load_metrics("a", per_step[1]["a.gate"]) | expert_load_metrics("b", per_step[1]["b.gate"])
    assert {k: v for k, v in metrics.items() if "load" in k} == pytest.approx(want)
    assert per_step[0]["a.gate"].tolist() != per_step[1]["a.gate"].tolist()  # the steps differ
    assert metrics["moe/a/aux_loss"] > 0 and "moe/aux_loss" in metrics
    metrics.resolve()  # nothing pending: no change
    assert {k: v for k, v in metrics.items() if "load" in k} == pytest.approx(want)


def test_step_metrics_run_a_deferred_fill_once_and_the_newest_per_key() -> None:
    from d9d.engine.step_metrics import StepMetrics

    metrics = StepMetrics()
    calls: list[str] = []
    metrics.defer("k", lambda m: calls.append("old"))
    metrics.defer("k", lambda m: (calls.append("new"), m.update(x=2.0)))
    metrics.defer("other", lambda m: calls.append("other"))
    assert calls == [] and dict(metrics) == {}
    metrics.resolve()
    metrics.resolve()
    assert calls == ["new", "other"] and dict(metrics) == {"x": 2.0}
