"""The expert exchange with a static per-peer capacity (d9d.parallel.expert.capacity, d9d.engine.exchange):
against the reading exchange on gloo ranks, no host read in dispatch, overflows recorded exactly, and a
training run whose exchanges overflow rerunning its steps to the reading exchange's losses and metrics."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import parse_config
from d9d.engine.runtime import MetricPoint
from d9d.modules.moe.communication import RoutedTokens
from d9d.parallel.expert import AllToAllMoECommunication, ExchangeCapacity
from tests.harness import RankEnv, run_distributed
from tests.test_engine_builtin import ARCH
from tests.test_engine_nonfinite import _local
from tests.test_parallel_expert import _HostReads, _routing


def _run(
    comm: AllToAllMoECommunication, routed: RoutedTokens, experts: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Dispatch, tanh experts, combine, backward: (output, grad x, grad weights, grad experts, received
    rows per expert). Padding rows after the experts' groups get NaN outputs: a result reading one fails."""
    d = comm.dispatch(routed)
    counts = d.tokens_per_expert.tolist()
    valid = sum(counts)
    outs = [torch.tanh(rows @ experts[e]) for e, rows in enumerate(d.hidden_states[:valid].split(counts))]
    padding = torch.full((d.hidden_states.shape[0] - valid, experts.shape[-1]), float("nan"), dtype=dy.dtype)
    out = comm.combine(torch.cat([*outs, padding]), d)
    (out * dy).sum().backward()
    x, w = routed.hidden_states, routed.topk_weights
    assert x.grad is not None and w.grad is not None and experts.grad is not None
    return out.detach(), x.grad, w.grad, experts.grad, d.tokens_per_expert


def _capacity_exchange(env: RankEnv) -> None:
    for ep in (2, env.world_size):
        groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, env.world_size, ep)]
        group = groups[env.rank // ep]
        ep_rank = env.rank % ep
        num_experts, k = 4 * ep, 2
        local_n = num_experts // ep
        # skewed loads; different token counts per rank, and a rank without tokens: the capacity is rows
        # per peer, not a fraction of the sender's tokens, so ranks need not agree on their batch shapes
        for case in ("one_expert", "same_rank", "uneven", "empty_rank"):
            what = f"ep={ep} case={case}"
            x, ids, w = _routing(env.rank, num_experts, k, case, ep)
            g = torch.Generator().manual_seed(3)
            experts = torch.randn(num_experts, 5, 5, generator=g, dtype=x.dtype)
            experts = experts[ep_rank * local_n : (ep_rank + 1) * local_n]
            dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(env.rank), dtype=x.dtype)

            def routed(
                x: torch.Tensor = x, ids: torch.Tensor = ids, w: torch.Tensor = w, n: int = num_experts
            ) -> RoutedTokens:
                return RoutedTokens(x.clone().requires_grad_(), ids, w.clone().requires_grad_(), n)

            reading = _run(AllToAllMoECommunication(group), routed(), experts.clone().requires_grad_(), dy)
            # Independent count: copies this rank sends to each peer, and every rank's ([source][peer]).
            sent = torch.bincount(ids.flatten() // local_n, minlength=ep).double()
            gathered = [torch.zeros_like(sent) for _ in range(ep)]
            dist.all_gather(gathered, sent, group=group)
            pairs = [row.tolist() for row in gathered]

            # calibration: the reading exchange records the copies it sent to each peer
            capacity = ExchangeCapacity(1.0, rank=ep_rank, peers=ep, align=1)
            comm = AllToAllMoECommunication(group, capacity=capacity)
            calibrating = _run(comm, routed(), experts.clone().requires_grad_(), dy)
            for got, want in zip(calibrating, reading, strict=True):
                assert torch.equal(got, want), what
            record = capacity.take()
            assert record is not None and record.tolist() == [0.0, *sent.tolist()], what

            # enough room, each pair its own (at least one row): no host read in dispatch, results bitwise
            # the reading exchange's
            capacity.fit(pairs)
            assert capacity.rows == [[max(int(n), 1) for n in row] for row in pairs], what
            with _HostReads() as reads:
                d = comm.dispatch(routed())
            assert reads.reads == [], (what, reads.reads)
            received = sum(capacity.rows[source][ep_rank] for source in range(ep))
            assert d.hidden_states.shape[0] == received, what  # static: the pairs' rows into this rank
            fitted = _run(comm, routed(), experts.clone().requires_grad_(), dy)
            for got, want in zip(fitted, reading, strict=True):
                assert torch.equal(got, want), what
            record = capacity.take()
            assert record is not None and record.tolist() == [0.0, *sent.tolist()], what

            # one row short on the busiest pair: exactly the rank that sends it overflows
            busiest = max(((s, d) for s in range(ep) for d in range(ep)), key=lambda sd: pairs[sd[0]][sd[1]])
            short = [list(row) for row in capacity.rows]
            short[busiest[0]][busiest[1]] -= 1
            capacity.set_rows(short)
            comm.dispatch(routed())
            record = capacity.take()
            overflowed = float(ep_rank == busiest[0])
            assert record is not None and record.tolist() == [overflowed, *sent.tolist()], what
            assert capacity.take() is None  # taken: cleared


@pytest.mark.distributed
def test_capacity_exchange_matches_the_reading_exchange_without_host_reads() -> None:
    run_distributed(_capacity_exchange, 4, timeout=180)


def test_capacity_fits_each_pair_grows_the_overflowing_ones_and_recalibrates_down() -> None:
    capacity = ExchangeCapacity(1.25, rank=1, peers=2, align=64, growth=1.5, recalibrate_every=100)
    assert capacity.rows is None
    capacity.fit([[100, 10], [300, 0]])  # each pair its own: 125 -> 128, 12.5 -> 64, 375 -> 384, 0 -> 64
    assert capacity.rows == [[128, 64], [384, 64]]
    assert capacity.send_splits() == [384, 64] and capacity.recv_splits() == [64, 64]  # rank 1's
    assert (capacity.largest, capacity.smallest) == (384, 64)
    # An overflow of two pairs: 1.25 × 130 = 162.5 -> 192 and 1.5 × 128 = 192; 1.25 × 70 -> 128 but at
    # least 1.5 × 64 = 96 -> 128; the pairs within their rows and headroom keep them (1.25 × 300 -> 384).
    capacity.grow([[130, 70], [300, 0]])
    assert capacity.rows == [[192, 128], [384, 64]]
    capacity.grow([[200, 0], [0, 0]])  # kept rising: 1.25 × 200 -> 256, at least 1.5 × 192 = 288 -> 320
    assert capacity.rows == [[320, 128], [384, 64]]
    # Another pair overflows (130 > 128) while pair (1, 0) comes within its headroom (320 < 384, but
    # 1.25 × 320 = 400): that one is topped up to 448 at this rerun instead of overflowing at a later step;
    # the pairs with headroom left (1.25 × 100 -> 128 < 320, 1.25 × 0) keep theirs.
    capacity.grow([[100, 130], [320, 0]])
    assert capacity.rows == [[320, 192], [448, 64]]
    capacity.fit([[10, 0], [0, 0]])  # recalibration follows the loads down, to one aligned block at least
    assert capacity.rows == [[64, 64], [64, 64]]
    splits = capacity.splits_on(torch.device("cpu"))  # [(sent, start), (received, start)]
    assert splits.tolist() == [[[64, 64], [0, 64]], [[64, 64], [0, 64]]]
    with pytest.raises(ValueError, match="2 x 2"):
        capacity.set_rows([[1, 2, 3]])
    # the record: overflowed if any pair's copies passed its rows; the window: the largest per peer
    capacity.record(torch.tensor([3, 70]), torch.tensor([64, 64]))
    record = capacity.take()
    assert record is not None and record.tolist() == [1.0, 3.0, 70.0]
    for loads in ([12, 1], [2, 2]):
        capacity.record(torch.tensor(loads), torch.tensor([64, 64]))
        capacity.take()
    window = capacity.take_window()
    assert window is not None and window.tolist() == [12.0, 70.0] and capacity.take_window() is None
    only_grows = ExchangeCapacity(1.25, rank=0, peers=2)  # no recalibration: no window is kept
    only_grows.record(torch.tensor([3, 9]), None)
    assert only_grows.take() is not None and only_grows.take_window() is None
    with pytest.raises(ValueError, match="must be >= 1"):
        ExchangeCapacity(0.9, rank=0, peers=2)
    with pytest.raises(ValueError, match=r"growth 0\.5 must be >= 1"):
        ExchangeCapacity(1.1, rank=0, peers=2, growth=0.5)
    with pytest.raises(ValueError, match="not in an expert-parallel group of 2"):
        ExchangeCapacity(1.1, rank=2, peers=2)


# -- through the engine: overflowing steps rerun to the reading exchange's results ----------------------


DP2_EP2 = {"data_parallel_replicate": 2, "expert_parallel": 2}
# Sized exactly to the loads seen, growth 2 after an overflow, then every 2 steps back to the loads seen:
# capacities shrink, and overflow and rerun again.
GROWING_AND_SHRINKING = {
    "kind": "all_to_all",
    "capacity_factor": 1.0,
    "capacity_align": 1,
    "capacity_growth": 2.0,
    "capacity_recalibrate_every": 2,
}


def _config(
    run_dir: Path, backend: dict[str, Any], mesh: dict[str, int], schedule: str | None
) -> dict[str, Any]:
    return {
        "run": {"name": run_dir.name, "dir": str(run_dir)},
        "mesh": mesh,
        "pipelining": None if schedule is None else {"kind": schedule},
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": 6},
        "logging": {"progress_bar": "off", "period": 1},
        "checkpointing": {"save_at_end": False},
        "model": {
            "provider": "qwen3_moe",
            "options": {"architecture": ARCH, "parallel": {"expert_backend": backend}},
        },
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
    }


def _train(
    env: RankEnv,
    name: str,
    backend: dict[str, Any],
    mesh: dict[str, int] = DP2_EP2,
    schedule: str | None = None,
    sections: dict[str, Any] | None = None,
) -> None:
    """Train the job (`sections` replace whole sections of it, e.g. `compile`) and save its losses, step
    metrics, router loads, repeated steps and this rank's final parameters under the rank's tmp dir."""
    from d9d.core.context import DistributedContext
    from d9d.engine.events import EventBus, OptimizerStepFinished, StepRepeated
    from d9d.engine.trainer import Trainer
    from d9d.modules.moe.router import TopKRouter

    config = parse_config({**_config(env.tmp_dir / name, backend, mesh, schedule), **(sections or {})})
    ctx = DistributedContext.create(config.mesh)
    points: list[MetricPoint] = []
    events = EventBus()
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 1, points.append), events)
    loads: list[list[int]] = []
    routers: list[TopKRouter] = []
    repeated: list[int] = []
    # Subscribed before the model's balancer (which sums and clears the loads after each update): the
    # copies each router counted for the step's update, this rank's own.
    events.subscribe(
        OptimizerStepFinished,
        lambda e: loads.append([int(r.expert_load.sum()) for r in routers]),
    )
    events.subscribe(StepRepeated, lambda e: repeated.append(e.step))
    trainer.setup()
    routers.extend(m for mod in trainer.modules for m in mod.modules() if isinstance(m, TopKRouter))
    result = trainer.train()
    final = {n: _local(p) for m in trainer.modules for n, p in m.named_parameters()}
    if env.rank == 0:
        train = [p.values for p in points if p.kind == "train"]
        torch.save(
            {"losses": list(result.losses), "metrics": train, "loads": loads, "repeated": repeated},
            env.tmp_dir / f"{name}.pt",
        )
    torch.save(final, env.tmp_dir / f"{name}-{env.rank}.params.pt")


@pytest.mark.distributed
def test_overflowing_steps_rerun_to_the_reading_exchange_results(tmp_path: Path) -> None:
    """Capacity factor 1 and no rounding: after the first step the capacity is exactly its largest load, so
    later steps overflow; each reruns. Losses, gradient norms, the MoE balance metrics and the final
    parameters equal the reading exchange's run, bitwise on CPU, and each update counts every routed copy
    once (the dropped pass's router loads do not add up)."""
    reading = {"kind": "all_to_all"}
    capacity = GROWING_AND_SHRINKING
    run_distributed(_train, 2, "reading", reading, tmp_dir=tmp_path, timeout=300)
    run_distributed(_train, 2, "capacity", capacity, tmp_dir=tmp_path, timeout=300)
    want, got = torch.load(tmp_path / "reading.pt"), torch.load(tmp_path / "capacity.pt")
    assert got["losses"] == want["losses"]
    assert got["repeated"], "no step overflowed: the rerun path did not run"
    assert got["metrics"][-1]["exchange_reruns"] == len(got["repeated"])
    rows = [m["exchange_capacity_rows"] for m in got["metrics"]]
    assert any(b < a for a, b in itertools.pairwise(rows)), f"no recalibration shrank: {rows}"
    assert any(b > a for a, b in itertools.pairwise(rows)), f"no overflow grew: {rows}"
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"], strict=True)):
        shared = sorted(k for k in w if k.startswith("moe/") or k in ("loss", "grad_norm"))
        assert shared and {k: g[k] for k in shared} == {k: w[k] for k in shared}, step
    # 2 microbatches of 2 sequences of 8 tokens per rank and step, top-2: 64 copies per router
    copies = 2 * 2 * 8 * ARCH["num_experts_per_tok"]
    assert got["loads"] == want["loads"] == [[copies] * ARCH["num_layers"]] * 6
    for rank in range(2):
        a = torch.load(tmp_path / f"capacity-{rank}.params.pt")
        b = torch.load(tmp_path / f"reading-{rank}.params.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rank


def _train_spying_on_traces(
    env: RankEnv, name: str, backend: dict[str, Any], sections: dict[str, Any]
) -> None:
    """`_train`, noting for every run of the capacity dispatch's Python code whether dynamo was tracing
    it (True) or it ran eagerly (False): a dispatch traced into the compiled block runs no Python at all
    afterwards, so an eager run of it after calibration is a graph break."""
    from d9d.parallel.expert.all_to_all import AllToAllMoECommunication

    original = AllToAllMoECommunication._dispatch_copies_capacity
    seen: dict[bool, bool] = {}  # a dict, not a list: a list's length is guarded, a recompile per call

    def spy(self: AllToAllMoECommunication, routed: Any, capacity: Any) -> Any:
        seen[torch.compiler.is_compiling()] = True
        return original(self, routed, capacity)

    AllToAllMoECommunication._dispatch_copies_capacity = spy  # type: ignore[method-assign]
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("d9d").addHandler(handler)
    logging.getLogger("d9d").setLevel(logging.INFO)  # d9d sets it only where it adds its own handler
    _train(env, name, backend, DP2_EP2, None, sections)
    if env.rank == 0:  # the one longer compile is announced where it starts
        (env.tmp_dir / f"{name}.log").write_text("\n".join(messages))
    # compiled variants of `dispatch` (its own frame on CPU, where the eager grouped matmul breaks the graph)
    variants = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(AllToAllMoECommunication.dispatch))
    torch.save((sorted(seen), variants), env.tmp_dir / f"{name}-{env.rank}.traced.pt")


@pytest.mark.distributed
def test_the_capacity_exchange_is_traced_into_the_compiled_block(tmp_path: Path) -> None:
    """Compiled blocks: once calibrated the exchange reads no split size, so it is traced with the layer
    (functional collectives) rather than run eagerly between compiled pieces — also after its capacities
    grew and shrank (the ints become symbols: no recompile per layer or per capacity) — and the run equals
    the compiled reading exchange's bitwise (`aot_eager`: the same ops, traced)."""
    sections = {"compile": {"enabled": True, "backend": "aot_eager"}}
    reading, capacity = {"kind": "all_to_all"}, GROWING_AND_SHRINKING
    run_distributed(_train_spying_on_traces, 2, "reading", reading, sections, tmp_dir=tmp_path, timeout=300)
    run_distributed(_train_spying_on_traces, 2, "capacity", capacity, sections, tmp_dir=tmp_path, timeout=300)
    want, got = torch.load(tmp_path / "reading.pt"), torch.load(tmp_path / "capacity.pt")
    assert got["repeated"], "no step overflowed: the capacities never changed"
    assert got["losses"] == want["losses"]
    assert "compiled blocks now trace again" in (tmp_path / "capacity.log").read_text()
    assert "trace again" not in (tmp_path / "reading.log").read_text()
    for rank in range(2):
        traced, variants = torch.load(tmp_path / f"capacity-{rank}.traced.pt")
        assert traced == [True], f"rank {rank}: the capacity dispatch ran eagerly (False in {traced})"
        # uncalibrated; the spy's first note; the first layer of a step (no load recorded yet); the others —
        # not one per capacity (they changed at every step)
        assert variants <= 4, f"rank {rank}: {variants} compiled variants of the dispatch"
        a = torch.load(tmp_path / f"capacity-{rank}.params.pt")
        b = torch.load(tmp_path / f"reading-{rank}.params.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rank


# Exactly the first step's largest load, no rounding: later steps overflow and rerun.
EXACT_CAPACITY = {"kind": "all_to_all", "capacity_factor": 1.0, "capacity_align": 1}


def _six_layers(backend: dict[str, Any]) -> dict[str, Any]:
    """The model section with 6 layers: a V schedule at pp 2 needs a layer per stage (embedding and head
    count as layers in the split)."""
    model: dict[str, Any] = _config(Path("unused"), backend, DP2_EP2, None)["model"]
    model["options"]["architecture"] = {**ARCH, "num_layers": 6}
    return {"model": model}


@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["1f1b", "zbv", "1f1b-full-ac"])
def test_overflowing_steps_rerun_under_pipeline_and_expert_parallelism(tmp_path: Path, variant: str) -> None:
    """pp 2 × dp 2 × ep 2: the overflow flag of either stage reaches every rank through the loss
    all-reduce, both stages rerun together, and the losses equal the reading exchange's bitwise — under
    1F1B, under ZBV (split backward: the weight passes of the dropped pass must not leak into the rerun)
    and with full activation checkpointing (each recompute dispatches again at the same capacity)."""
    mesh = {"pipeline_parallel": 2, "data_parallel_replicate": 2, "expert_parallel": 2}
    schedule = variant.split("-")[0]
    for name, backend in (("pp-reading", {"kind": "all_to_all"}), ("pp-capacity", EXACT_CAPACITY)):
        sections: dict[str, Any] = {}
        if schedule == "zbv":
            sections = _six_layers(backend)
        if variant.endswith("full-ac"):
            sections["activation_checkpointing"] = {"mode": "full"}
        run_distributed(_train, 4, name, backend, mesh, schedule, sections, tmp_dir=tmp_path, timeout=400)
    want, got = torch.load(tmp_path / "pp-reading.pt"), torch.load(tmp_path / "pp-capacity.pt")
    assert got["repeated"], "no step overflowed: the rerun path did not run"
    assert got["losses"] == want["losses"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "mesh",
    [
        {"context_parallel_shard": 2, "expert_parallel": 2},  # the ep ranks hold halves of each sequence
        {"tensor_parallel": 2, "expert_parallel": 2},  # token-split MoE layers
    ],
    ids=["cp2xep2", "tp2xep2"],
)
def test_overflowing_steps_rerun_under_context_and_tensor_parallelism(
    tmp_path: Path, mesh: dict[str, int]
) -> None:
    """The static-capacity exchange where the expert ranks split sequences (cp) or route a token split (tp):
    steps overflow and rerun, and the losses equal the reading exchange's bitwise."""
    run_distributed(_train, 2, "reading", {"kind": "all_to_all"}, mesh, tmp_dir=tmp_path, timeout=300)
    run_distributed(_train, 2, "capacity", EXACT_CAPACITY, mesh, tmp_dir=tmp_path, timeout=300)
    want, got = torch.load(tmp_path / "reading.pt"), torch.load(tmp_path / "capacity.pt")
    assert got["repeated"], "no step overflowed: the rerun path did not run"
    assert got["losses"] == want["losses"]


@pytest.mark.distributed
def test_a_resumed_run_keeps_the_capacities_of_the_uninterrupted_one(tmp_path: Path) -> None:
    """Capacities grow on overflows and shrink every 2 steps; a run stopped after step 3 and resumed equals
    the uninterrupted run in each step's capacity, rerun count and loss: the capacities and the loads since
    the last recalibration come back from the checkpoint, so the resumed run neither reads its split sizes
    to calibrate anew nor recalibrates from fewer steps' loads."""
    capacity = GROWING_AND_SHRINKING
    stop = {"checkpointing": {"save_at_end": True}, "run": {"name": "split", "dir": str(tmp_path / "split")}}
    run_distributed(_train, 2, "straight", capacity, DP2_EP2, None, None, tmp_dir=tmp_path, timeout=300)
    first = {**stop, "trainer": {"total_steps": 3}}
    run_distributed(_train, 2, "first", capacity, DP2_EP2, None, first, tmp_dir=tmp_path, timeout=300)
    run_distributed(_train, 2, "resumed", capacity, DP2_EP2, None, stop, tmp_dir=tmp_path, timeout=300)
    straight, resumed = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert straight["repeated"], "no step overflowed: the capacities never grew"
    assert resumed["losses"] == straight["losses"]
    keys = ("exchange_capacity_rows", "exchange_reruns", "loss")

    def steps(metrics: list[dict[str, float]]) -> list[dict[str, float | None]]:
        return [{k: m.get(k) for k in keys} for m in metrics if "loss" in m]

    assert steps(resumed["metrics"]) == steps(straight["metrics"])[3:]
