"""MoE token movement: the permutation, permute / combine custom ops (PyTorch reference and Triton through
the interpreter) against plain float64 computations, their eager path against the custom ops, and a tiny MoE
layer compiled with fullgraph=True."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.kernels.backend import KernelBackend
from d9d.kernels.moe import (
    block_regroup,
    combine_tokens,
    count_per_expert,
    expert_permutation,
    permute_tokens,
)
from d9d.modules.moe import GroupedExperts, LocalMoECommunication, MoELayer, TopKRouter, TorchGroupedMM
from tests.triton_interpreter import run_in_interpreter

# Uneven loads with empty experts: expert 0 and 3 never chosen, expert 5 takes most copies.
_IDS = torch.tensor([[5, 1], [5, 2], [1, 5], [4, 5], [5, 2], [2, 1], [5, 4]])
_EXPERTS = 6


def _loop_combine(rows: torch.Tensor, weights: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(slot_rows.shape[0], rows.shape[1], dtype=torch.float64)
    for t in range(slot_rows.shape[0]):
        for j in range(slot_rows.shape[1]):
            out[t] += weights[t, j].double() * rows[slot_rows[t, j]].double()
    return out


@pytest.mark.parametrize("align", [1, 4])
def test_permutation_groups_copies_by_expert_in_token_order(align: int) -> None:
    perm = expert_permutation(_IDS, _EXPERTS, align=align)
    counts = torch.bincount(_IDS.flatten(), minlength=_EXPERTS)
    assert torch.equal(count_per_expert(_IDS, _EXPERTS), counts)
    assert int(perm.rows_per_expert.sum()) == perm.num_rows
    assert sorted(perm.slot_rows.flatten().tolist()) == sorted(set(perm.slot_rows.flatten().tolist()))
    starts = perm.rows_per_expert.cumsum(0) - perm.rows_per_expert
    for e in range(_EXPERTS):
        slots = (e == _IDS).nonzero()  # row-major: token order
        rows = perm.slot_rows[slots[:, 0], slots[:, 1]]
        assert rows.tolist() == list(range(int(starts[e]), int(starts[e]) + len(slots))), e
        assert int(starts[e]) % align == 0
        assert int(perm.rows_per_expert[e]) >= int(counts[e])
    if align == 1:
        assert perm.num_rows == _IDS.numel()


@pytest.mark.parametrize("num_experts", [6, 256, 257, 40_000])
def test_permutation_is_the_stable_sort_by_expert_at_every_key_width(num_experts: int) -> None:
    """The sort runs on the narrowest integer that holds the ids (uint8 up to 256 experts, int16, int32): the
    slots are those of a Python stable sort of the int64 ids, with ids at both ends of the range."""
    g = torch.Generator().manual_seed(num_experts)
    ids = torch.randint(0, num_experts, (50, 3), generator=g)
    ids[0, 0], ids[1, 1], ids[2, 2] = num_experts - 1, 0, num_experts - 1
    perm = expert_permutation(ids, num_experts)
    flat = ids.flatten().tolist()
    order = sorted(range(len(flat)), key=lambda i: flat[i])  # stable
    expected = torch.empty(len(flat), dtype=torch.long)
    expected[order] = torch.arange(len(flat))
    assert torch.equal(perm.slot_rows.flatten(), expected)
    assert torch.equal(perm.rows_per_expert, torch.bincount(ids.flatten(), minlength=num_experts))


def _regroup_by_loops(counts: torch.Tensor) -> tuple[list[int], list[int]]:
    """What `block_regroup` means, written as loops: walk the target groups (chunk, expert) and, inside
    each, the sources' blocks in order, handing out positions; read them back in arrival order."""
    chunks, sources, experts = counts.shape
    arrival_start, start = {}, 0
    for c in range(chunks):
        for s in range(sources):
            for e in range(experts):
                arrival_start[c, s, e] = start
                start += int(counts[c, s, e])
    slots, position = [0] * start, 0
    for c in range(chunks):
        for e in range(experts):
            for s in range(sources):
                for i in range(int(counts[c, s, e])):
                    slots[arrival_start[c, s, e] + i] = position
                    position += 1
    return slots, counts.sum(1).reshape(-1).tolist()


@pytest.mark.parametrize(("chunks", "sources", "experts"), [(1, 1, 1), (1, 4, 5), (3, 2, 4), (2, 3, 1)])
def test_block_regroup_against_loops(chunks: int, sources: int, experts: int) -> None:
    g = torch.Generator().manual_seed(chunks * 100 + sources * 10 + experts)
    for trial in range(4):
        counts = torch.randint(0, 6, (chunks, sources, experts), generator=g)
        if trial == 0:
            counts[..., 0] = 0  # an expert nobody sends to
        if trial == 1:
            counts.zero_()
        num_rows = int(counts.sum())
        got = block_regroup(counts, num_rows, backend="torch")
        slots, per_expert = _regroup_by_loops(counts)
        assert got.num_rows == num_rows
        assert got.slot_rows.flatten().tolist() == slots, counts
        assert got.rows_per_expert.tolist() == per_expert
    # a transposed (non-contiguous) count tensor, as the overlapped exchange passes it
    counts = torch.randint(0, 6, (sources, chunks, experts), generator=g).transpose(0, 1)
    got = block_regroup(counts, int(counts.sum()), backend="torch")
    assert got.slot_rows.flatten().tolist() == _regroup_by_loops(counts)[0]
    with pytest.raises(ValueError, match=r"\[chunks, sources, experts\]"):
        block_regroup(counts[0], 3)


@pytest.mark.parametrize("align", [1, 4])
def test_permute_and_combine_against_float64_loops(align: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(7, 2, generator=g, dtype=torch.float64, requires_grad=True)
    perm = expert_permutation(_IDS, _EXPERTS, align=align)
    rows = permute_tokens(x, perm.slot_rows, perm.num_rows, backend="torch")
    filled = torch.zeros(perm.num_rows, dtype=torch.bool)
    filled[perm.slot_rows.flatten()] = True
    for t in range(7):
        for j in range(2):
            assert torch.equal(rows[perm.slot_rows[t, j]], x[t])
    assert rows[~filled].abs().sum() == 0  # padding rows are zero
    transformed = torch.tanh(rows) * torch.arange(1, perm.num_rows + 1, dtype=torch.float64)[:, None]
    out = combine_tokens(transformed, perm.slot_rows, weights=w, backend="torch")
    torch.testing.assert_close(out, _loop_combine(transformed, w, perm.slot_rows))
    # gradients against the same function written with plain indexing (autograd of index ops)
    dy = torch.randn(7, 5, generator=g, dtype=torch.float64)
    (out * dy).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rows2 = torch.zeros(perm.num_rows, 5, dtype=torch.float64).index_put(
        (perm.slot_rows.flatten(),), x2.repeat_interleave(2, 0)
    )
    t2 = torch.tanh(rows2) * torch.arange(1, perm.num_rows + 1, dtype=torch.float64)[:, None]
    out2 = (t2[perm.slot_rows] * w2[..., None]).sum(1)
    (out2 * dy).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_custom_ops_pass_opcheck_and_gradcheck() -> None:
    g = torch.Generator().manual_seed(1)
    perm = expert_permutation(_IDS, _EXPERTS, align=2)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(7, 2, generator=g, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(perm.num_rows, 3, generator=g, dtype=torch.float64, requires_grad=True)
    scatter = torch.ops.d9d.moe_scatter_rows.default
    gather = torch.ops.d9d.moe_gather_sum.default
    for weights in (None, w):
        torch.library.opcheck(scatter, (x, weights, perm.slot_rows, perm.num_rows, "torch"))
        torch.library.opcheck(gather, (rows, weights, perm.slot_rows, "torch"))
    torch.autograd.gradcheck(lambda a, b: scatter(a, b, perm.slot_rows, perm.num_rows, "torch"), (x, w))
    torch.autograd.gradcheck(lambda a, b: gather(a, b, perm.slot_rows, "torch"), (rows, w))


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


def test_eager_calls_skip_the_custom_op_dispatcher_and_compiled_ones_trace_the_ops() -> None:
    """Outside a compiled region permute/combine run as plain autograd Functions (the dispatcher's host cost
    doubled each call's on an H200) with the custom ops' results and gradients, bitwise; a compiled
    region still sees the custom ops, opaque and without a graph break."""
    g = torch.Generator().manual_seed(2)
    perm = expert_permutation(_IDS, _EXPERTS, align=2)
    x = torch.randn(7, 3, generator=g, requires_grad=True)
    w = torch.rand(7, 2, generator=g, requires_grad=True)
    dy = torch.randn(7, 3, generator=g)

    def through_api(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rows = permute_tokens(a, perm.slot_rows, perm.num_rows, weights=b)
        return combine_tokens(torch.tanh(rows), perm.slot_rows, weights=b)

    def through_ops(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rows = torch.ops.d9d.moe_scatter_rows(a, b, perm.slot_rows, perm.num_rows, "torch")
        return torch.ops.d9d.moe_gather_sum(torch.tanh(rows), b, perm.slot_rows, "torch")

    with _OpNames() as seen:
        out = through_api(x, w)
        grads = torch.autograd.grad(out, (x, w), dy)
    assert not any(name.startswith("d9d::") for name in seen.names), seen.names
    expected = through_ops(x, w)
    assert torch.equal(out, expected)
    for got, want in zip(grads, torch.autograd.grad(expected, (x, w), dy), strict=True):
        assert torch.equal(got, want)

    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(through_api, fullgraph=True, backend=capture)
    assert torch.equal(compiled(x, w), expected)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert {"d9d.moe_scatter_rows.default", "d9d.moe_gather_sum.default"} <= targets, targets


# Absent (negative) slots, as the expert-parallel exchange passes them: 4 received rows, k = 3, 6 present
# copies over a 6-row buffer; row 3 is named by one slot, one row has all its slots present.
_SPARSE_SLOTS = torch.tensor([[4, -1, 0], [-1, -1, 5], [1, 2, 3], [-1, -1, -1]])


def _loop_scatter(
    x: torch.Tensor, weights: torch.Tensor, slot_rows: torch.Tensor, num_rows: int
) -> torch.Tensor:
    rows = torch.zeros(num_rows, x.shape[1], dtype=torch.float64)
    for t in range(slot_rows.shape[0]):
        for j in range(slot_rows.shape[1]):
            if slot_rows[t, j] >= 0:
                rows[slot_rows[t, j]] = weights[t, j].double() * x[t].double()
    return rows


def test_absent_slots_write_nothing_add_nothing_and_get_zero_weight_gradient() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    rows = permute_tokens(x, _SPARSE_SLOTS, 6, weights=w, backend="torch")
    torch.testing.assert_close(rows, _loop_scatter(x, w, _SPARSE_SLOTS, 6), rtol=0, atol=0)
    present = _SPARSE_SLOTS >= 0
    # an absent slot of a non-finite buffer stays out of the sum (selected away, not multiplied by 0)
    poisoned = torch.randn(6, 5, generator=g, dtype=torch.float64)
    out = combine_tokens(poisoned, _SPARSE_SLOTS, weights=w, backend="torch")
    loop = _loop_combine(poisoned, torch.where(present, w, 0), _SPARSE_SLOTS.clamp(min=0))
    torch.testing.assert_close(out, loop, rtol=0, atol=1e-15)
    assert out[3].abs().sum() == 0  # a token with no present slot gets zero
    with_nan = torch.cat([poisoned, torch.full((1, 5), float("nan"), dtype=torch.float64)])
    assert combine_tokens(with_nan, _SPARSE_SLOTS, weights=w, backend="torch").isfinite().all()
    # gradients: against plain indexing over the present slots only
    (out.pow(2).sum() + rows.pow(2).sum()).backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    t_idx, j_idx = present.nonzero(as_tuple=True)
    r_idx = _SPARSE_SLOTS[t_idx, j_idx]
    rows2 = torch.zeros(6, 5, dtype=torch.float64).index_put((r_idx,), x2[t_idx] * w2[t_idx, j_idx, None])
    out2 = torch.zeros(4, 5, dtype=torch.float64).index_add(
        0, t_idx, poisoned[r_idx] * w2[t_idx, j_idx, None]
    )
    (out2.pow(2).sum() + rows2.pow(2).sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-13, atol=1e-13)
    assert w.grad[~present].abs().sum() == 0
    rows_in = poisoned.clone().requires_grad_()
    torch.autograd.gradcheck(
        lambda a, b: combine_tokens(a, _SPARSE_SLOTS, weights=b, backend="torch"), (rows_in, w)
    )
    torch.autograd.gradcheck(
        lambda a, b: permute_tokens(a, _SPARSE_SLOTS, 6, weights=b, backend="torch"), (x, w)
    )
    for weights in (None, w):
        torch.library.opcheck(torch.ops.d9d.moe_scatter_rows.default, (x, weights, _SPARSE_SLOTS, 6, "torch"))
        torch.library.opcheck(
            torch.ops.d9d.moe_gather_sum.default, (rows_in, weights, _SPARSE_SLOTS, "torch")
        )
    # every slot absent over an empty buffer
    none = torch.full((2, 3), -1)
    assert permute_tokens(x[:2], none, 0, backend="torch").shape == (0, 5)
    empty_out = combine_tokens(x.new_zeros(0, 5), none, weights=w[:2], backend="torch")
    assert empty_out.shape == (2, 5) and empty_out.abs().sum() == 0


def test_reference_compact_and_dense_forms_agree() -> None:
    """The reference's two forms (compacted present slots, the CPU default; dense and sync-free, the CUDA
    one) on random sparse slots, half-precision included, against float64 loops."""
    from d9d.kernels.moe.reference import gather_sum_torch, scatter_rows_torch, slot_dot_torch

    g = torch.Generator().manual_seed(4)
    tokens, k, hidden = 9, 4, 6
    present = torch.rand(tokens, k, generator=g) < 0.4
    num_rows = int(present.sum())
    slots = torch.full((tokens, k), -1)
    slots[present] = torch.randperm(num_rows, generator=g)
    for dtype in (torch.float64, torch.bfloat16):
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        w = torch.rand(tokens, k, generator=g).to(dtype)
        rows = torch.randn(num_rows, hidden, generator=g).to(dtype)
        grad = torch.randn(tokens, hidden, generator=g).to(dtype)
        tol = {"rtol": 0, "atol": 1e-14} if dtype == torch.float64 else {"rtol": 1e-2, "atol": 1e-2}
        scattered = [scatter_rows_torch(x, w, slots, num_rows, compact=c) for c in (True, False)]
        gathered = [gather_sum_torch(rows, w, slots, compact=c) for c in (True, False)]
        dots = [slot_dot_torch(rows, grad, slots, compact=c) for c in (True, False)]
        for got in scattered:
            torch.testing.assert_close(got.double(), _loop_scatter(x, w, slots, num_rows), **tol)
        for got in gathered:
            want = _loop_combine(rows, torch.where(present, w, 0), slots.clamp(min=0))
            torch.testing.assert_close(got.double(), want, **tol)
        want_dot = torch.zeros(tokens, k, dtype=torch.float64)
        for t, j in present.nonzero().tolist():
            want_dot[t, j] = (rows[slots[t, j]].double() * grad[t].double()).sum()
        for got in dots:
            torch.testing.assert_close(got.double(), want_dot, **tol)
        assert scattered[0].dtype == scattered[1].dtype == gathered[0].dtype == gathered[1].dtype == dtype


def test_empty_batch() -> None:
    ids = torch.empty(0, 2, dtype=torch.long)
    perm = expert_permutation(ids, 4, align=4)
    x = torch.randn(0, 8, requires_grad=True)
    rows = permute_tokens(x, perm.slot_rows, perm.num_rows, backend="torch")
    assert rows.shape == (12, 8) and rows.abs().sum() == 0
    out = combine_tokens(rows, perm.slot_rows, weights=torch.ones(0, 2), backend="torch")
    assert out.shape == (0, 8)


def test_tiny_moe_layer_compiles_fullgraph() -> None:
    """Routing, permutation, grouped matmul, combine and the balancing-loss hook trace as one graph (bf16:
    `torch._grouped_mm`'s shape function wants it)."""
    torch.manual_seed(0)
    layer = MoELayer(
        TopKRouter(16, 4, 2, expert_bias=True),
        GroupedExperts(4, 16, 16, grouped_mm=TorchGroupedMM()),
        communication=LocalMoECommunication(align=4),
        aux_loss_coef=0.01,
    ).bfloat16()
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    expected = layer(x)
    expected.float().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    layer.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    got.float().sum().backward()
    torch.testing.assert_close(got, expected)
    for a, b in zip([p.grad for p in layer.parameters() if p.grad is not None], grads, strict=True):
        torch.testing.assert_close(a, b)
    assert len(grads) == 3  # router, the fused gate-up and the down projection


# Runs in a fresh interpreter: Triton reads TRITON_INTERPRET when `@triton.jit` decorates.
_INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    import d9d.kernels.moe.triton_kernels as tk
    from d9d.kernels.moe import combine_tokens, expert_permutation, permute_tokens

    tk._BLOCK = 16  # several blocks per row and a ragged last one
    ids = torch.tensor([[5, 1], [5, 2], [1, 5], [4, 5], [5, 2], [2, 1], [5, 4]])  # experts 0, 3 empty
    g = torch.Generator().manual_seed(0)
    for dtype, hidden, align, tol in [(torch.float32, 37, 1, 1e-6), (torch.float32, 16, 4, 1e-6),
                                      (torch.bfloat16, 40, 1, 1e-2)]:
        perm = expert_permutation(ids, 6, align=align)
        results = {}
        for backend in ("torch", "triton"):
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(7, hidden, generator=gen).to(dtype).requires_grad_()
            w = torch.rand(7, 2, generator=gen).to(dtype).requires_grad_()
            scale = torch.randn(perm.num_rows, hidden, generator=gen).to(dtype)
            rows = permute_tokens(x, perm.slot_rows, perm.num_rows, backend=backend)
            out = combine_tokens(rows * scale, perm.slot_rows, weights=w, backend=backend)
            dy = torch.randn(7, hidden, generator=gen).to(dtype)
            (out.float() * dy.float()).sum().backward()
            # and a weighted permute, whose weight gradient takes the other operand order
            w2 = w.detach().clone().requires_grad_()
            scattered = permute_tokens(x.detach(), perm.slot_rows, perm.num_rows, weights=w2, backend=backend)
            (scattered.float() * scale.float()).sum().backward()
            results[backend] = (rows, out, x.grad, w.grad, scattered, w2.grad)
        for a, b in zip(results["triton"], results["torch"]):
            assert a.dtype == b.dtype, (a.dtype, b.dtype)
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    # absent (negative) slots: masked off in every kernel
    slots = torch.tensor([[4, -1, 0], [-1, -1, 5], [1, 2, 3], [-1, -1, -1]])
    for dtype, hidden, tol in [(torch.float32, 37, 1e-6), (torch.bfloat16, 20, 1e-2)]:
        results = {}
        for backend in ("torch", "triton"):
            gen = torch.Generator().manual_seed(2)
            x = torch.randn(4, hidden, generator=gen).to(dtype).requires_grad_()
            w = torch.rand(4, 3, generator=gen).to(dtype).requires_grad_()
            scale = torch.randn(6, hidden, generator=gen).to(dtype)
            rows = permute_tokens(x, slots, 6, backend=backend)
            out = combine_tokens(rows * scale, slots, weights=w, backend=backend)
            dy = torch.randn(4, hidden, generator=gen).to(dtype)
            (out.float() * dy.float()).sum().backward()
            w2 = w.detach().clone().requires_grad_()
            scattered = permute_tokens(x.detach(), slots, 6, weights=w2, backend=backend)
            (scattered.float() * scale.float()).sum().backward()
            results[backend] = (rows, out, x.grad, w.grad, scattered, w2.grad)
        for a, b in zip(results["triton"], results["torch"]):
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
        assert results["triton"][3][slots < 0].abs().sum() == 0
    # an empty batch launches nothing
    empty = expert_permutation(torch.empty(0, 2, dtype=torch.long), 4)
    assert permute_tokens(torch.randn(0, 8), empty.slot_rows, 0, backend="triton").shape == (0, 8)
    # the block regroup against its sorting path, with several loop iterations per block, empty blocks,
    # nothing at all, and more blocks than one power of two
    tk._REGROUP_ROWS = 4
    from d9d.kernels.moe import block_regroup
    for shape in [(1, 4, 5), (3, 2, 3), (2, 1, 1), (1, 1, 1), (3, 4, 5)]:
        counts = torch.randint(0, 11, shape, generator=g)
        counts[..., 0] = 0
        for c in (counts, torch.zeros_like(counts)):
            n = int(c.sum())
            a, b = block_regroup(c, n, backend="triton"), block_regroup(c, n, backend="torch")
            assert torch.equal(a.slot_rows, b.slot_rows) and torch.equal(a.rows_per_expert, b.rows_per_expert)
    print("interpreter ok")
    """
)


def test_triton_kernels_match_reference_in_the_interpreter() -> None:
    run_in_interpreter(_INTERPRETER_CHECK)


@pytest.mark.gpu
def test_triton_kernels_match_reference_on_cuda() -> None:
    g = torch.Generator().manual_seed(0)
    tokens, k, experts, hidden = 4096, 8, 64, 1024
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).cuda()
    ids[: tokens // 2, 0] = 3  # uneven
    perm = expert_permutation(ids, experts, align=16)
    results = {}
    for backend in ("torch", "triton"):
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(tokens, hidden, generator=gen).cuda().bfloat16().requires_grad_()
        w = torch.rand(tokens, k, generator=gen).cuda().bfloat16().requires_grad_()
        rows = permute_tokens(x, perm.slot_rows, perm.num_rows, backend=backend)
        out = combine_tokens(rows * 1.5, perm.slot_rows, weights=w, backend=backend)
        out.float().pow(2).sum().backward()
        results[backend] = (rows, out, x.grad, w.grad)
    for a, b in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_block_regroup_kernel_matches_sorting_on_cuda() -> None:
    """The exchange's regroup shapes (4 sources × 16 local experts, one chunk and three) with uneven and
    empty blocks, ~130k rows: the kernel's positions are the sorting path's."""
    g = torch.Generator().manual_seed(7)
    for chunks in (1, 3):
        counts = torch.randint(0, 4096, (chunks, 4, 16), generator=g)
        counts[:, :, 3] = 0
        counts = counts.cuda()
        n = int(counts.sum())
        a, b = block_regroup(counts, n, backend="triton"), block_regroup(counts, n, backend="torch")
        assert torch.equal(a.slot_rows, b.slot_rows) and torch.equal(a.rows_per_expert, b.rows_per_expert)


@pytest.mark.gpu
def test_triton_kernels_with_absent_slots_match_reference_on_cuda() -> None:
    """The expert-parallel receiver's shape of slots: [rows, k] with about a quarter present."""
    g = torch.Generator().manual_seed(5)
    tokens, k, hidden = 4096, 8, 1024
    present = torch.rand(tokens, k, generator=g) < 0.27
    num_rows = int(present.sum())
    slots = torch.full((tokens, k), -1)
    slots[present] = torch.randperm(num_rows, generator=g)
    slots = slots.cuda()
    results = {}
    for backend in ("torch", "triton"):
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(tokens, hidden, generator=gen).cuda().bfloat16().requires_grad_()
        w = torch.rand(tokens, k, generator=gen).cuda().bfloat16().requires_grad_()
        rows = permute_tokens(x, slots, num_rows, backend=backend)
        out = combine_tokens(rows * 1.5, slots, weights=w, backend=backend)
        out.float().pow(2).sum().backward()
        results[backend] = (rows, out, x.grad, w.grad)
    for a, b in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert results["triton"][3][~present.cuda()].abs().sum() == 0


@pytest.mark.gpu
def test_moe_layer_on_cuda_triton_aligned_matches_reference_path() -> None:
    """The production path (Triton permute/combine, aligned groups, torch._grouped_mm, bf16) against the
    reference path (PyTorch ops, unaligned) on the same weights."""
    results = []
    cases: list[tuple[KernelBackend, int]] = [("torch", 1), ("triton", 16)]
    for backend, align in cases:
        torch.manual_seed(0)
        layer = (
            MoELayer(
                TopKRouter(256, 16, 4),
                GroupedExperts(16, 256, 128, grouped_mm=TorchGroupedMM()),
                communication=LocalMoECommunication(align=align, backend=backend),
                aux_loss_coef=0.01,
            )
            .cuda()
            .bfloat16()
        )
        x = torch.randn(4, 512, 256, device="cuda").bfloat16().requires_grad_()
        out = layer(x)
        out.float().pow(2).mean().backward()
        assert x.grad is not None
        results.append([out.float(), x.grad.float(), *(p.grad.float() for p in layer.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
