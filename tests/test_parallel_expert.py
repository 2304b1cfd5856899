"""Expert-parallel token exchange against the single-process permutation, and backend selection."""

from __future__ import annotations

import logging
import sys
import types
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from pydantic import TypeAdapter, ValidationError
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import d9d.kernels.moe.reference as moe_reference
from d9d.core import DeviceMeshParameters, DistributedContext, MeshDomain
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe.communication import RoutedTokens
from d9d.modules.moe.experts import GroupedExperts
from d9d.modules.moe.layer import MoELayer
from d9d.modules.moe.router import TopKRouter
from d9d.parallel import GradientSynchronizer, collect_synced_params, parallelize_replicate
from d9d.parallel.expert import (
    AllToAllBackendConfig,
    AllToAllMoECommunication,
    AutoBackendConfig,
    DeepEPBackendConfig,
    DeepEPMoECommunication,
    ExpertCommunicationConfig,
    build_moe_communication,
    deep_ep_available,
    parallelize_expert_parallel,
)
from tests.harness import RankEnv, run_distributed
from tests.test_parallel_reference import (
    Batch,
    assert_runs_close,
    distributed_run,
    full_state,
    load_full_state,
    reference_run,
)

HIDDEN = 5


def _routing(
    rank: int, num_experts: int, k: int, case: str, ep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-rank tokens and routing; `case` shapes the imbalance."""
    g = torch.Generator().manual_seed(1000 * rank + sum(map(ord, case)))
    tokens = {"uneven": 3 + 4 * rank, "empty_rank": 0 if rank == 1 else 6, "one_expert": 7, "same_rank": 6}[
        case
    ]
    x = torch.randn(tokens, HIDDEN, generator=g, dtype=torch.float64)
    local_n = num_experts // ep
    if case == "one_expert":  # every copy goes to expert 1 (k = 1): every other rank receives nothing
        ids = torch.stack([torch.full((tokens,), 1), torch.full((tokens,), num_experts - 1)], 1)[:, :k]
    elif case == "same_rank":  # each token's k experts all sit on one rank (drawn per token)
        home = torch.randint(0, ep, (tokens,), generator=g)
        ids = torch.stack([h * local_n + torch.randperm(local_n, generator=g)[:k] for h in home])
    else:  # experts 0 and 2 are never chosen: zero counts inside a rank's expert range
        allowed = torch.tensor([e for e in range(num_experts) if e not in (0, 2)])
        picks = [allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(tokens)]
        ids = torch.stack(picks) if picks else torch.empty(0, k, dtype=torch.long)
    w = torch.rand(tokens, k, generator=g, dtype=torch.float64)
    return x, ids.long(), w


def _expert_weights(num_experts: int) -> torch.Tensor:
    return torch.randn(
        num_experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )


def _reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    # out[t] = Σ_k w[t,k] · tanh(x[t] @ W_{id[t,k]}), written without any permutation
    return torch.einsum("tk,tkh->th", w, torch.tanh(torch.einsum("th,tkhj->tkj", x, experts[ids])))


def _rows_to_each_rank(ids: torch.Tensor, local_n: int, ep: int, dedup: bool) -> list[int]:
    """Hidden-state rows one sender's routing puts on the wire to each rank, counted with plain loops: a
    row per distinct (token, rank) pair deduplicated, a row per (token, expert) copy otherwise."""
    rows = [0] * ep
    for token in ids.tolist():
        ranks = [e // local_n for e in token]
        for r in set(ranks) if dedup else ranks:
            rows[r] += 1
    return rows


class _WireLog:
    """Records every `all_to_all_single` this process issues: (input shape, dtype, input split sizes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], torch.dtype, list[int] | None]] = []
        self._original = dist.all_to_all_single

    def __enter__(self) -> _WireLog:
        def record(output: torch.Tensor, input: torch.Tensor, *args: object, **kwargs: object) -> object:
            splits = kwargs.get("input_split_sizes", args[1] if len(args) > 1 else None)
            self.calls.append((tuple(input.shape), input.dtype, list(splits) if splits is not None else None))
            return self._original(output, input, *args, **kwargs)  # type: ignore[arg-type]

        dist.all_to_all_single = record  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self._original

    def hidden_splits(self) -> list[list[int] | None]:
        """Split sizes of the messages carrying hidden-state rows, in issue order: float64 [rows, HIDDEN], or
        a byte message packing such a row with others (the deduplicated dispatch: rows, weights, ids)."""
        hidden_bytes = HIDDEN * torch.finfo(torch.float64).bits // 8
        return [
            splits
            for shape, dtype, splits in self.calls
            if (dtype == torch.float64 and shape[1:] == (HIDDEN,))
            or (dtype == torch.uint8 and len(shape) == 2 and shape[1] >= hidden_bytes)
        ]


def _exchange(env: RankEnv) -> None:
    tight = {"rtol": 1e-12, "atol": 1e-12}  # float64: only the per-token summation order may differ
    for ep in (2, env.world_size):
        groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, env.world_size, ep)]
        group = groups[env.rank // ep]
        ep_rank = env.rank % ep
        peers = [r for r in range(env.world_size) if r // ep == env.rank // ep]
        for dedup in (True, False):
            comm = AllToAllMoECommunication(group, dedup=dedup)
            for num_experts, k in ((2 * ep, 2), (3 * ep, 1)):
                full_experts = _expert_weights(num_experts)
                local_n = num_experts // ep
                for case in ("uneven", "empty_rank", "one_expert", "same_rank"):
                    what = f"ep={ep} dedup={dedup} experts={num_experts} k={k} case={case}"
                    x, ids, w = _routing(env.rank, num_experts, k, case, ep)
                    x.requires_grad_()
                    w.requires_grad_()
                    local_experts = (
                        full_experts[ep_rank * local_n : (ep_rank + 1) * local_n].clone().requires_grad_()
                    )
                    with _WireLog() as wire:
                        d = comm.dispatch(RoutedTokens(x, ids, w, num_experts))
                        assert d.tokens_per_expert.shape == (local_n,), what
                        assert int(d.tokens_per_expert.sum()) == d.hidden_states.shape[0], what
                        outs = [
                            torch.tanh(rows @ local_experts[e])
                            for e, rows in enumerate(d.hidden_states.split(d.tokens_per_expert.tolist()))
                        ]
                        out = comm.combine(torch.cat(outs), d)
                        dy = torch.randn(
                            out.shape, generator=torch.Generator().manual_seed(env.rank), dtype=torch.float64
                        )
                        (out * dy).sum().backward()

                    # What went on the wire: every hidden-state message (dispatch, combine, and both
                    # backwards) carries exactly the rows counted independently from the routing.
                    sent = _rows_to_each_rank(ids, local_n, ep, dedup)
                    received = [
                        _rows_to_each_rank(_routing(r, num_experts, k, case, ep)[1], local_n, ep, dedup)[
                            ep_rank
                        ]
                        for r in peers
                    ]
                    assert wire.hidden_splits() == [sent, received, sent, received], what
                    assert d.hidden_states.shape[0] == sum(  # the receiver expands to one row per copy
                        _rows_to_each_rank(_routing(r, num_experts, k, case, ep)[1], local_n, ep, False)[
                            ep_rank
                        ]
                        for r in peers
                    ), what
                    if case == "same_rank" and dedup:
                        assert sum(sent) == ids.shape[0], what  # a token whose experts share a rank: one row

                    # Reference: the same math on this rank's tokens, and every group rank's for expert grads.
                    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
                    experts_ref = full_experts.clone().requires_grad_()
                    want = _reference(xr, ids, wr, experts_ref)
                    (want * dy).sum().backward()
                    torch.testing.assert_close(out, want, msg=what, **tight)
                    torch.testing.assert_close(x.grad, xr.grad, msg=what, **tight)
                    torch.testing.assert_close(w.grad, wr.grad, msg=what, **tight)
                    expert_grad_ref = torch.zeros_like(full_experts)
                    for r in peers:
                        xo, io, wo = _routing(r, num_experts, k, case, ep)
                        eo = full_experts.clone().requires_grad_()
                        dyo = torch.randn(
                            xo.shape, generator=torch.Generator().manual_seed(r), dtype=torch.float64
                        )
                        (_reference(xo, io, wo, eo) * dyo).sum().backward()
                        expert_grad_ref += eo.grad
                    mine = expert_grad_ref[ep_rank * local_n : (ep_rank + 1) * local_n]
                    torch.testing.assert_close(local_experts.grad, mine, msg=what, **tight)


@pytest.mark.distributed
def test_all_to_all_matches_local_permutation() -> None:
    """Both exchanges (deduplicated and one row per copy) at ep 2 and 4, output and every gradient against
    plain float64 math, and the rows each puts on the wire against counts taken from the routing."""
    run_distributed(_exchange, 4, timeout=180)


# -- host synchronization on the hot path ---------------------------------------------------------------

# aten ops that make the host wait for the device on CUDA: a scalar read, or an output whose size depends on
# the data (a boolean index is a nonzero underneath).
_SYNCING_OPS = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "masked_select",
    "bincount",
    "unique_dim",
    "_unique2",
}


class _HostReads(TorchDispatchMode):
    """Counts device→host reads: `Tensor.cpu()` / `.tolist()` calls, and the aten ops above.

    On CPU the MoE kernels' PyTorch reference compacts the present slots with `nonzero` (free there; on
    CUDA, where it would wait for the device, the reference takes a dense form): inside this mode it takes
    the CUDA form, so what is counted is the exchange's own reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self._saved = (torch.Tensor.cpu, torch.Tensor.tolist)
        self._compact = moe_reference._compact

    def __enter__(self) -> _HostReads:
        cpu, tolist = self._saved
        moe_reference._compact = lambda slot_rows, compact: False

        def counted_cpu(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.reads.append("Tensor.cpu")
            host = cpu(t, *args, **kwargs)
            host._d9d_on_host = True  # type: ignore[attr-defined]
            return host

        def counted_tolist(t: torch.Tensor) -> Any:
            # a list read from a tensor `.cpu()` already brought over costs nothing more
            if not getattr(t, "_d9d_on_host", False):
                self.reads.append("Tensor.tolist")
            return tolist(t)

        torch.Tensor.cpu = counted_cpu  # type: ignore[method-assign]
        torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.cpu, torch.Tensor.tolist = self._saved  # type: ignore[method-assign]
        moe_reference._compact = self._compact
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _SYNCING_OPS:
            self.reads.append(name)
        if name in ("index", "index_put", "index_put_") and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        ):
            self.reads.append(f"{name} with a boolean mask")
        if (
            name == "repeat_interleave"
            and kwargs.get("output_size") is None
            and isinstance(args[0], torch.Tensor)
        ):
            self.reads.append("repeat_interleave without output_size")
        out = func(*args, **kwargs)
        return out


def _host_syncs(env: RankEnv) -> None:
    group = dist.new_group(list(range(env.world_size)))
    num_experts, k = 4 * env.world_size, 3
    for dedup in (True, False):
        comm = AllToAllMoECommunication(group, dedup=dedup)
        x, ids, w = _routing(env.rank, num_experts, k, "uneven", env.world_size)
        x.requires_grad_()
        w.requires_grad_()
        with _HostReads() as dispatch_reads:
            d = comm.dispatch(RoutedTokens(x, ids, w, num_experts))
        # the split sizes, once: what `all_to_all_single` needs as Python ints
        assert dispatch_reads.reads == ["Tensor.cpu"], (dedup, dispatch_reads.reads)
        expert_out = torch.tanh(d.hidden_states) * torch.arange(1.0, d.hidden_states.shape[0] + 1)[:, None]
        with _HostReads() as combine_reads:
            out = comm.combine(expert_out, d)
            out.pow(2).sum().backward()
        assert combine_reads.reads == [], (dedup, combine_reads.reads)
        assert x.grad is not None and w.grad is not None


@pytest.mark.distributed
def test_exchange_reads_the_host_once_per_dispatch_and_never_in_combine_or_backward() -> None:
    run_distributed(_host_syncs, 2, timeout=60)


class _LoggedDist:
    """`torch.distributed` for `d9d.parallel.expert.overlap`, noting each all-to-all's launch and wait."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> Any:
        n = sum(e.startswith("launch") for e in self.events)
        self.events.append(f"launch {n}")
        work = dist.all_to_all_single(*args, **kwargs)
        events = self.events

        class Logged:
            def wait(self) -> None:
                work.wait()
                events.append(f"wait {n}")

        return Logged()


class _NoteBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, events: list[str], what: str) -> torch.Tensor:
        ctx.note = (events, what)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        events, what = ctx.note
        events.append(what)
        return grad, None, None


def _overlap_order(env: RankEnv) -> None:
    import d9d.parallel.expert.overlap as overlap

    group = dist.new_group(list(range(env.world_size)))
    num_experts, k = 2 * env.world_size, 2
    events: list[str] = []
    overlap.dist = _LoggedDist(events)  # type: ignore[assignment]  # this rank's process only
    comm = AllToAllMoECommunication(group, overlap_chunks=2)
    x, ids, w = _routing(env.rank, num_experts, k, "uneven", env.world_size)
    x.requires_grad_()
    calls: list[int] = []

    def experts(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        chunk = len(calls)
        calls.append(chunk)
        events.append(f"experts {chunk}")
        # in backward the note comes just before this chunk's expert gradients (made after them in forward)
        return _NoteBackward.apply(torch.tanh(rows), events, f"experts backward {chunk}")

    with _HostReads() as reads:
        out = comm.exchange(RoutedTokens(x, ids, w, num_experts), experts)
    assert reads.reads == ["Tensor.cpu"], reads.reads  # both chunks' split sizes in one read
    with _HostReads() as reads:
        out.pow(2).sum().backward()
    assert reads.reads == [], reads.reads

    def in_flight_during(what: str) -> list[int]:
        at = events.index(what)
        launched = {int(e.split()[1]) for e in events[:at] if e.startswith("launch")}
        return sorted(n for n in launched if f"wait {n}" in events[at:])

    # forward: chunk 1's rows travel while chunk 0's experts run, chunk 0's results while chunk 1's run
    assert in_flight_during("experts 0") == [1], events
    assert in_flight_during("experts 1") == [2], events
    # backward: each chunk's expert gradients are computed while a gradient of the other chunk travels
    assert in_flight_during("experts backward 1") == [5], events  # chunk 0's combine gradient
    assert in_flight_during("experts backward 0") == [6], events  # chunk 1's dispatch gradient
    assert sum(e.startswith("launch") for e in events) == 8, events  # 2 chunks x (dispatch, combine) x 2

    # With a shared expert: it runs while chunk 0's rows travel (the first dispatch no longer exposed), and
    # its gradient while chunk 0's dispatch gradient travels.
    events.clear()
    calls.clear()

    def shared() -> torch.Tensor:
        events.append("shared")
        return _NoteBackward.apply(x * 3, events, "shared backward")

    out = comm.exchange(RoutedTokens(x, ids, w, num_experts), experts, shared)
    out.pow(2).sum().backward()
    assert in_flight_during("shared") == [0, 1], events
    assert in_flight_during("experts 0") == [1], events
    assert in_flight_during("shared backward") == [6, 7], events


@pytest.mark.distributed
def test_overlapped_exchange_keeps_a_transfer_in_flight_while_each_chunks_experts_run() -> None:
    """`overlap_chunks: 2`: the order of launches, waits and expert (and shared-expert) compute in forward
    and backward (its results are checked against one process in the float64 layer test below)."""
    run_distributed(_overlap_order, 2, timeout=60)


def _cuda_syncs(env: RankEnv) -> None:
    """The same on NCCL with CUDA's own sync detector, for both exchanges and the overlapped one: one
    synchronizing call in dispatch (in the overlapped exchange's forward), none after; and the deduplicated
    and overlapped exchanges against the copy exchange in bf16."""
    torch.cuda.set_device(env.rank)
    group = dist.new_group(list(range(env.world_size)), backend="nccl")
    device = torch.device("cuda", env.rank)
    num_experts, k, hidden, tokens = 16, 4, 256, 512
    g = torch.Generator().manual_seed(env.rank)
    x = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16).requires_grad_()
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)]).to(device)
    w = torch.rand(tokens, k, generator=g).to(device, torch.bfloat16).requires_grad_()
    results: dict[bool, tuple[torch.Tensor, ...]] = {}
    for dedup in (True, False):
        comm = AllToAllMoECommunication(group, dedup=dedup)
        comm.dispatch(RoutedTokens(x, ids, w, num_experts))  # warm-up: first-call allocations, kernel loads
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as dispatch_warnings:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                d = comm.dispatch(RoutedTokens(x, ids, w, num_experts))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # (the detector's own "prototype feature ... synchronizing operations" notice is not a sync)
        syncs = [m for m in dispatch_warnings if "called a synchronizing CUDA operation" in str(m.message)]
        assert len(syncs) == 1, (dedup, [str(m.message) for m in syncs])
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = comm.combine(d.hidden_states * 2, d)
            out.float().pow(2).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert x.grad is not None and w.grad is not None
        results[dedup] = (d.tokens_per_expert, out.float(), x.grad.float(), w.grad.float())
        x.grad = w.grad = None
    # The copy exchange overlapped in 2 chunks (async NCCL all-to-alls, waits on the compute stream): one
    # synchronizing call for the whole exchange, none in backward, and the copy exchange's results.
    comm = AllToAllMoECommunication(group, overlap_chunks=2)
    comm.exchange(RoutedTokens(x, ids, w, num_experts), lambda rows, _counts: rows * 2)  # warm-up
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as exchange_warnings:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = comm.exchange(RoutedTokens(x, ids, w, num_experts), lambda rows, _counts: rows * 2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [m for m in exchange_warnings if "called a synchronizing CUDA operation" in str(m.message)]
    assert len(syncs) == 1, [str(m.message) for m in syncs]
    torch.cuda.set_sync_debug_mode("error")
    try:
        out.float().pow(2).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and w.grad is not None
    for got, want in zip((out, x.grad, w.grad), results[False][1:], strict=True):
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    x.grad = w.grad = None
    # both exchanges give the same in bf16 (up to the rounding of each rank's partial)
    (counts, out, *grads), (counts2, out2, *grads2) = results[True], results[False]
    assert torch.equal(counts, counts2)
    torch.testing.assert_close(out, out2, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, grads2, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.gpus(2)
def test_exchange_host_syncs_on_gpus() -> None:
    run_distributed(_cuda_syncs, 2, timeout=300)


# -- the MoE layer under expert parallelism against the same layer in one process ---------------------


def _moe_layer(num_experts: int, k: int, hidden: int) -> MoELayer:
    """With a gated shared expert: the overlapped exchange runs it while the first chunk's rows travel."""
    torch.manual_seed(31)
    layer = MoELayer(
        TopKRouter(hidden, num_experts, k),
        GroupedExperts(num_experts, hidden, 4),
        shared_expert=SwiGLU(hidden, 3),
        shared_expert_gate=True,
    )
    return layer.double()


def _layer_tokens(rank: int, hidden: int) -> torch.Tensor:
    """Uneven tokens per rank, none on rank 3 (a rank that sends nothing)."""
    count = (5, 9, 3, 0)[rank]
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(70 + rank), dtype=torch.float64)


def _layer_against_single_process(env: RankEnv) -> None:
    num_experts, k, hidden = 8, 3, 6
    # The reference: the unsharded layer, run on each rank's tokens one rank at a time (the router's
    # float32 softmax then sees the very same rows as the sharded run, so routing is identical).
    ref = _moe_layer(num_experts, k, hidden)
    ref_grads: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(env.world_size):
        ref.zero_grad()
        xr = _layer_tokens(r, hidden).requires_grad_()
        out = ref(xr)
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(90 + r), dtype=torch.float64)
        (out * dy).sum().backward()
        ref_grads[r] = {"out": out.detach(), "x": xr.grad, "router": ref.gate.weight.grad.clone()}
        ref_grads[r]["shared"] = ref.shared_expert.gate_proj.weight.grad.clone()
        ref_grads[r]["shared_gate"] = ref.shared_expert_gate.weight.grad.clone()
        for name in ("gate_up_proj", "down_proj"):
            ref_grads[r][name] = getattr(ref.experts, name).grad.clone()
    for ep in (2, env.world_size):  # ep 2 runs with ep_replicate 2
        ctx = DistributedContext.create(
            DeviceMeshParameters(data_parallel_replicate=env.world_size, expert_parallel=ep), backend="gloo"
        )
        expert_mesh = ctx.mesh_for(MeshDomain.EXPERT)["ep_replicate", "ep_shard"]
        # chunks 3 on rank 2's 3 tokens: one each; rank 3 has none, so every chunk is empty
        for dedup, chunks in ((True, 1), (False, 1), (False, 2), (False, 3)):
            what = f"ep={ep} ep_replicate={env.world_size // ep} dedup={dedup} overlap_chunks={chunks}"
            layer = _moe_layer(num_experts, k, hidden)
            parallelize_expert_parallel(
                layer,
                expert_mesh,
                device=ctx.device,
                dtype=torch.float64,
                backend=AllToAllBackendConfig(dedup=dedup, overlap_chunks=chunks),
            )
            assert isinstance(layer.communication, AllToAllMoECommunication), what
            assert (layer.communication.dedup, layer.communication.overlap_chunks) == (dedup, chunks), what
            x = _layer_tokens(env.rank, hidden).requires_grad_()
            out = layer(x)
            dy = torch.randn(
                out.shape, generator=torch.Generator().manual_seed(90 + env.rank), dtype=torch.float64
            )
            (out * dy).sum().backward()
            tight = {"rtol": 1e-12, "atol": 1e-12, "msg": what}
            mine = ref_grads[env.rank]
            torch.testing.assert_close(out, mine["out"], **tight)
            torch.testing.assert_close(x.grad, mine["x"], **tight)
            # the router's gradient comes only through the routing weights (no balancing loss here)
            torch.testing.assert_close(layer.gate.weight.grad, mine["router"], **tight)
            torch.testing.assert_close(layer.shared_expert.gate_proj.weight.grad, mine["shared"], **tight)
            torch.testing.assert_close(layer.shared_expert_gate.weight.grad, mine["shared_gate"], **tight)
            local_n = num_experts // ep
            shard = ctx.mesh_for(MeshDomain.EXPERT)["ep_shard"].get_local_rank()
            for name in ("gate_up_proj", "down_proj"):
                grad = getattr(layer.experts, name).grad.to_local().clone()
                # this ep group's tokens only: add the other replicas' to compare with every rank's tokens
                dist.all_reduce(grad, group=expert_mesh["ep_replicate"].get_group())
                want = sum(ref_grads[r][name] for r in range(env.world_size))
                torch.testing.assert_close(grad, want[shard * local_n : (shard + 1) * local_n], **tight)


@pytest.mark.distributed
def test_moe_layer_under_expert_parallel_matches_single_process_in_float64() -> None:
    """Every exchange (deduplicated, copies, copies overlapped in 2 and 3 chunks) at ep 2 and 4, the layer
    with a gated shared expert."""
    run_distributed(_layer_against_single_process, 4, timeout=180)


# -- training an MoE model with expert parallelism against one process ---------------------------------


class TinyMoE(nn.Module):
    def __init__(self, num_experts: int = 8) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.inp = nn.Linear(4, 8)
        self.moe = MoELayer(
            TopKRouter(8, num_experts, 2), GroupedExperts(num_experts, 8, 6), shared_expert=SwiGLU(8, 6)
        )
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.moe(h))


def _moe_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return ((model(batch.inputs) - batch.targets).pow(2).sum(-1) * batch.weights).sum()


def _moe_batches(steps: int, size: int) -> list[Batch]:
    g = torch.Generator().manual_seed(21)
    return [
        Batch(
            torch.randn(size, 4, generator=g),
            torch.randn(size, 3, generator=g),
            torch.randint(0, 3, (size,), generator=g).float(),
        )
        for _ in range(steps)
    ]


def _ep_training(env: RankEnv) -> None:
    batches = _moe_batches(3, 16)
    ref_model = TinyMoE()
    init = full_state(ref_model)
    ref = reference_run(ref_model, batches, _moe_loss, max_norm=0.5)
    for ep in (2, env.world_size):
        case = f"dp_replicate={env.world_size} ep={ep}"
        ctx = DistributedContext.create(
            DeviceMeshParameters(data_parallel_replicate=env.world_size, expert_parallel=ep), backend="gloo"
        )
        model = TinyMoE()
        expert_mesh = ctx.mesh_for(MeshDomain.EXPERT)["ep_replicate", "ep_shard"]
        parallelize_expert_parallel(
            model.moe, expert_mesh, device=ctx.device, dtype=torch.float32, backend=AllToAllBackendConfig()
        )
        parallelize_replicate(model, ctx.mesh_for(MeshDomain.DENSE)["dp_cp_replicate"])
        assert isinstance(model.moe.communication, AllToAllMoECommunication)
        assert model.moe.experts.gate_up_proj.to_local().shape[0] == 8 // ep, case
        load_full_state(model, init)
        sync = GradientSynchronizer(
            collect_synced_params(model), loss_weight_mesh=ctx.mesh_for(MeshDomain.BATCH)["dp"]
        )
        local = [b.shard(env.world_size, env.rank).split(2) for b in batches]
        got = distributed_run(model, sync, local, _moe_loss, max_norm=0.5)
        assert_runs_close(got, ref, case)
        sync.close()


@pytest.mark.distributed
def test_expert_parallel_training_matches_single_process() -> None:
    run_distributed(_ep_training, 4, timeout=180)


# -- backend selection -------------------------------------------------------------------------------


def _selection(env: RankEnv) -> None:
    # the default group: a second gloo group's full-mesh connect once failed here under load (a CI flake)
    group = dist.group.WORLD
    assert group is not None
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    build = build_moe_communication
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("d9d.parallel.expert.backend")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    for _ in range(3):  # DeepEP cannot run on CPU: `auto` takes the all-to-all and has nothing to say
        comm = build(AutoBackendConfig(), group, device=cpu, dtype=torch.float32)
        assert isinstance(comm, AllToAllMoECommunication)
    assert not records
    assert isinstance(
        build(AutoBackendConfig(), group, device=cpu, dtype=torch.bfloat16), AllToAllMoECommunication
    )
    assert isinstance(
        build(AllToAllBackendConfig(), group, device=cuda, dtype=torch.bfloat16), AllToAllMoECommunication
    )
    if not deep_ep_available():
        with pytest.raises(RuntimeError, match="deep_ep package cannot be imported"):
            build(DeepEPBackendConfig(), group, device=cuda, dtype=torch.bfloat16)
        assert isinstance(
            build(AutoBackendConfig(), group, device=cuda, dtype=torch.bfloat16), AllToAllMoECommunication
        )
    # With a stand-in `deep_ep` module: selection only, no CUDA kernel runs (buffers are created lazily).
    fake = types.ModuleType("deep_ep")
    fake.Buffer = type("Buffer", (), {})  # type: ignore[attr-defined]
    sys.modules["deep_ep"] = fake
    try:
        # DeepEP could run here; `auto` still takes the all-to-all (measured faster) and says so once.
        for _ in range(3):
            comm = build(AutoBackendConfig(), group, device=cuda, dtype=torch.bfloat16)
            assert isinstance(comm, AllToAllMoECommunication)
        assert len(records) == 1 and "set expert_backend.kind: deep_ep" in records[0].getMessage()
        logger.removeHandler(handler)
        assert isinstance(
            build(AutoBackendConfig(), group, device=cuda, dtype=torch.float32), AllToAllMoECommunication
        )
        assert isinstance(
            build(AutoBackendConfig(), group, device=cpu, dtype=torch.bfloat16), AllToAllMoECommunication
        )
        assert isinstance(
            build(DeepEPBackendConfig(), group, device=cuda, dtype=torch.bfloat16), DeepEPMoECommunication
        )
        with pytest.raises(RuntimeError, match="needs CUDA"):
            build(DeepEPBackendConfig(), group, device=cpu, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="needs bfloat16"):
            build(DeepEPBackendConfig(), group, device=cuda, dtype=torch.float32)
        handler = DeepEPMoECommunication(group)
        x = torch.zeros(3, 4)
        with pytest.raises(TypeError, match="bfloat16"):
            handler.dispatch(RoutedTokens(x, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), 4))
    finally:
        del sys.modules["deep_ep"]


@pytest.mark.distributed
def test_backend_selection() -> None:
    adapter = TypeAdapter(ExpertCommunicationConfig)
    assert isinstance(adapter.validate_python({"kind": "deep_ep", "num_sms": 24}), DeepEPBackendConfig)
    assert isinstance(adapter.validate_python({"kind": "auto"}), AutoBackendConfig)
    with pytest.raises(ValidationError, match="multiple of 2"):
        adapter.validate_python({"kind": "deep_ep", "num_sms": 3})
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "nvshmem"})
    run_distributed(_selection, 2, timeout=60)


# -- backend selection through the engine's build path ------------------------------------------------

_ENGINE_ARCH = {
    "vocab_size": 32,
    "hidden_size": 16,
    "num_layers": 2,
    "num_attention_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 8,
    "intermediate_size": 24,
    "moe_intermediate_size": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


class _StandInDeepEP:
    """Records its construction instead of allocating DeepEP buffers (no CUDA here)."""

    def __init__(self, group: dist.ProcessGroup, *, num_sms: int | None = None) -> None:
        self.group = group


def _engine_selection(env: RankEnv, deep_ep_installed: bool, backend: dict[str, str]) -> None:
    """As the trainer builds stages: the provider builds on `meta`, then parallelizes with the rank's
    context, whose device is a GPU (an NCCL context reports `cuda:<local rank>`)."""
    from d9d.engine.builtin.models import builtin_provider
    from d9d.parallel.expert import backend as backend_module
    from d9d.pipeline.api import PipelineStageInfo

    ctx = DistributedContext.create(
        DeviceMeshParameters(data_parallel_replicate=2, expert_parallel=2), backend="gloo"
    )
    ctx.device = torch.device("cuda", env.rank)
    saved = (backend_module.deep_ep_available, backend_module.DeepEPMoECommunication)
    backend_module.deep_ep_available = lambda: deep_ep_installed  # type: ignore[assignment]
    backend_module.DeepEPMoECommunication = _StandInDeepEP  # type: ignore[assignment,misc]
    try:
        provider_class = builtin_provider("qwen3_moe")
        provider = provider_class(
            provider_class.Config.model_validate(
                {"architecture": _ENGINE_ARCH, "dtype": "bfloat16", "parallel": {"expert_backend": backend}}
            )
        )
        with torch.device("meta"):
            module = provider.build_stage(PipelineStageInfo())
        provider.parallelize(module, ctx)
    finally:
        backend_module.deep_ep_available, backend_module.DeepEPMoECommunication = saved
    layers = [m for m in module.modules() if isinstance(m, MoELayer)]
    assert len(layers) == 2
    expected = (
        _StandInDeepEP if deep_ep_installed and backend["kind"] == "deep_ep" else AllToAllMoECommunication
    )
    for layer in layers:
        assert isinstance(layer.communication, expected), type(layer.communication)


@pytest.mark.distributed
def test_engine_build_path_selects_deep_ep_when_asked() -> None:
    """`kind: deep_ep` builds DeepEP handlers; `auto` keeps the all-to-all even where DeepEP is installed."""
    run_distributed(_engine_selection, 2, True, {"kind": "auto"}, timeout=120)
    run_distributed(_engine_selection, 2, True, {"kind": "deep_ep"}, timeout=120)


@pytest.mark.distributed
def test_engine_build_path_falls_back_to_all_to_all_without_deep_ep() -> None:
    run_distributed(_engine_selection, 2, False, {"kind": "auto"}, timeout=120)


# -- DeepEP on GPUs ----------------------------------------------------------------------------------


def _deepep_vs_all_to_all(env: RankEnv) -> None:
    torch.cuda.set_device(env.rank)
    group = dist.new_group(list(range(env.world_size)), backend="nccl")
    device = torch.device("cuda", env.rank)
    num_experts, k, hidden, tokens = 8, 2, 256, 64 + 16 * env.rank
    g = torch.Generator().manual_seed(env.rank)
    x = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts - 2, generator=g)[:k] + 1 for _ in range(tokens)]).to(
        device
    )
    w = torch.rand(tokens, k, generator=g).to(device)
    local_n = num_experts // env.world_size
    experts = (
        torch.randn(num_experts, hidden, hidden, generator=torch.Generator().manual_seed(9)) / hidden**0.5
    )
    mine = experts[env.rank * local_n : (env.rank + 1) * local_n].to(device, torch.bfloat16)
    results = []
    for comm in (AllToAllMoECommunication(group), DeepEPMoECommunication(group)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        d = comm.dispatch(RoutedTokens(xi, ids, wi, num_experts))
        rows = torch.cat(
            [r @ mine[e] for e, r in enumerate(d.hidden_states.split(d.tokens_per_expert.tolist()))]
        )
        out = comm.combine(rows, d)
        out.float().pow(2).sum().backward()
        results.append((out.float(), xi.grad.float(), wi.grad.float(), d.tokens_per_expert.cpu()))
    (o1, gx1, gw1, t1), (o2, gx2, gw2, t2) = results
    assert torch.equal(t1, t2)
    torch.testing.assert_close(o2, o1, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx2, gx1, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(gw2, gw1, rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.gpus(2)
def test_deepep_matches_all_to_all_on_gpus() -> None:
    if not deep_ep_available():
        pytest.skip("deep_ep is not installed on this machine")
    run_distributed(_deepep_vs_all_to_all, 2, timeout=300)
