"""Split backward (input pass, then deferred weight pass) against a plain backward of an identical model."""

from __future__ import annotations

import copy
import gc
import importlib
import weakref

import torch
from torch import nn

from d9d.pipeline.api import needed_input_grads
from d9d.pipeline.autograd import backward_input


class _RecordingLinear(torch.autograd.Function):
    """x @ w.T computing only the gradients autograd asks for, and recording what it was asked."""

    calls: list[tuple[bool, bool]] = []  # noqa: RUF012 - shared log, reset per test

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        wants_x, wants_w = needed_input_grads(ctx)
        _RecordingLinear.calls.append((wants_x, wants_w))
        gx = grad @ w if wants_x else None
        gw = grad.flatten(0, -2).t() @ x.flatten(0, -2) if wants_w else None
        return gx, gw


class _Stage(nn.Module):
    """Exercises every kind of parameter the split must handle."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(6)
        self.custom_w = nn.Parameter(torch.randn(6, 6) * 0.3)
        self.tied = nn.Parameter(torch.randn(6, 6) * 0.3)  # used twice on the input path
        self.offset = nn.Parameter(torch.randn(6))  # feeds only the side output
        self.scale = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.lin(x))
        h = self.frozen(h) * self.scale
        h = self.norm(h)
        h = _RecordingLinear.apply(h, self.custom_w)
        h = torch.relu(h @ self.tied) @ self.tied
        side = (self.offset * 2).sum().expand(3)
        return h, side


def _params(m: nn.Module) -> list[nn.Parameter]:
    return list(m.parameters())


def test_split_matches_full_backward_for_inputs_and_every_parameter() -> None:
    torch.manual_seed(0)
    stage = _Stage().double()
    ref = copy.deepcopy(stage)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    g_main, g_side = torch.randn(4, 6, dtype=torch.float64), torch.randn(3, dtype=torch.float64)

    out_ref = ref(x_ref)
    torch.autograd.backward(list(out_ref), [g_main, g_side])

    out = stage(x)
    _RecordingLinear.calls.clear()
    (gx,), deferred = backward_input(list(out), [g_main, g_side], [x], _params(stage))
    assert _RecordingLinear.calls == [(True, False)], "the input pass must not ask for the weight gradient"
    assert all(p.grad is None for n, p in stage.named_parameters() if n != "tied"), "weights waited"
    torch.testing.assert_close(gx, x_ref.grad, rtol=1e-12, atol=1e-12)

    deferred.run()
    assert _RecordingLinear.calls == [(True, False), (False, True)], "the weight pass must not redo dX"
    for (name, p), p_ref in zip(stage.named_parameters(), ref.parameters(), strict=True):
        if not p.requires_grad:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_first_stage_without_differentiable_inputs_defers_everything() -> None:
    torch.manual_seed(1)
    emb, lin = nn.Embedding(10, 5), nn.Linear(5, 5)
    emb_ref, lin_ref = copy.deepcopy(emb), copy.deepcopy(lin)
    ids = torch.randint(0, 10, (3, 4))
    g = torch.randn(3, 4, 5)
    lin_ref(emb_ref(ids)).backward(g)

    grads, deferred = backward_input([lin(emb(ids))], [g], [ids], [*emb.parameters(), *lin.parameters()])
    assert grads == [None]
    assert all(p.grad is None for p in [*emb.parameters(), *lin.parameters()])
    deferred.run()
    for p, p_ref in zip(
        [*emb.parameters(), *lin.parameters()], [*emb_ref.parameters(), *lin_ref.parameters()], strict=True
    ):
        torch.testing.assert_close(p.grad, p_ref.grad)


def test_accumulation_hooks_fire_once_per_parameter_and_microbatch() -> None:
    torch.manual_seed(2)
    stage = _Stage()
    counts = {name: 0 for name, p in stage.named_parameters() if p.requires_grad}
    for name, p in stage.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda _, name=name: counts.__setitem__(name, counts[name] + 1)
            )
    for _ in range(3):
        x = torch.randn(2, 6, requires_grad=True)
        out = stage(x)
        _, deferred = backward_input(list(out), [torch.ones_like(o) for o in out], [x], _params(stage))
        deferred.run()
    assert counts == dict.fromkeys(counts, 3)


def test_unused_input_and_missing_output_gradient() -> None:
    lin = nn.Linear(3, 3)
    x, unused = torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    out = lin(x)
    grads, deferred = backward_input([out, out * 2], [torch.ones_like(out), None], [x, unused], _params(lin))
    assert grads[1] is None
    torch.testing.assert_close(grads[0], torch.ones(2, 3) @ lin.weight)
    deferred.run()
    torch.testing.assert_close(lin.weight.grad, torch.ones(3, 2) @ x.detach())


def test_deferred_pass_releases_the_graph_it_kept() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = lin(x)
    _, deferred = backward_input([out], [torch.ones_like(out)], [x], _params(lin))
    kept = weakref.ref(out)
    del out
    gc.collect()
    assert kept() is not None, "the weight pass needs the graph until it runs"
    deferred.run()
    gc.collect()
    assert kept() is None


def test_plain_backward_still_gets_every_gradient_from_custom_functions() -> None:
    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    _RecordingLinear.calls.clear()
    _RecordingLinear.apply(x, w).sum().backward()
    assert _RecordingLinear.calls == [(True, True)]
    torch.testing.assert_close(w.grad, torch.ones(4, 2) @ x.detach())


def test_activation_checkpointing_inside_the_stage() -> None:
    torch.manual_seed(3)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    a_ref, b_ref = copy.deepcopy(a), copy.deepcopy(b)

    def block(h: torch.Tensor, first: nn.Module, second: nn.Module) -> torch.Tensor:
        return second(torch.tanh(first(h)))

    x = torch.randn(3, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    g = torch.randn(3, 4)
    block(x_ref, a_ref, b_ref).backward(g)
    out = torch.utils.checkpoint.checkpoint(block, x, a, b, use_reentrant=False)
    (gx,), deferred = backward_input([out], [g], [x], [*a.parameters(), *b.parameters()])
    deferred.run()
    torch.testing.assert_close(gx, x_ref.grad)
    for p, q in zip(
        [*a.parameters(), *b.parameters()], [*a_ref.parameters(), *b_ref.parameters()], strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad)


def test_loss_head_gradients_come_from_its_forward_in_the_input_pass(monkeypatch) -> None:
    """The chunked loss head computes its gradients in forward; a weight pass of its own would recompute every
    chunk's logits. Split backward must take them in the input pass and equal a plain backward."""
    # the module (the package exports its function under the same name)
    lce = importlib.import_module("d9d.modules.heads.linear_cross_entropy")

    torch.manual_seed(5)
    lin, head = nn.Linear(6, 6).double(), nn.Parameter(torch.randn(11, 6, dtype=torch.float64) * 0.3)
    lin_ref, head_ref = copy.deepcopy(lin), nn.Parameter(head.detach().clone())
    x = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    labels = torch.randint(0, 11, (10,))
    labels[3] = lce.IGNORE_INDEX
    lce.linear_cross_entropy(lin_ref(x_ref), [head_ref], labels, chunk_size=4).sum().mul(0.5).backward()

    logits_calls = []
    real = lce.vocab_logits
    monkeypatch.setattr(lce, "vocab_logits", lambda h, w: logits_calls.append(h.shape[0]) or real(h, w))
    loss = lce.linear_cross_entropy(lin(x), [head], labels, chunk_size=4).sum().mul(0.5)
    assert logits_calls == [4, 4, 2]  # the forward's chunks
    (gx,), deferred = backward_input([loss], [torch.ones_like(loss)], [x], [*lin.parameters(), head])
    assert head.grad is not None, "the head's weight gradient is taken in the input pass"
    assert all(p.grad is None for p in lin.parameters()), "the eager linear's still wait for the weight pass"
    deferred.run()
    assert logits_calls == [4, 4, 2], "no pass recomputed the logits"
    torch.testing.assert_close(gx, x_ref.grad, rtol=1e-12, atol=1e-12)
    for p, p_ref in zip([*lin.parameters(), head], [*lin_ref.parameters(), head_ref], strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-12, atol=1e-12)
