"""CPU smoke of `benchmarks/train_throughput.py`'s plumbing (its rows need CUDA): the activation-checkpointing
rows (`--d9d-ac`, `--titan-ac`) are planned, labelled, parsed back in the row's subprocess and compared with
their no-checkpointing rows; d9d's `selective-mix`, which torchtitan has no option for, is refused for the
torchtitan rows and compares with no torchtitan row; the d9d rows' job configs validate for every mode;
`--batch` / `--seq` reach the row's subprocess."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from tests.bench_fixtures import import_benchmark
from tests.harness import RankEnv, run_distributed


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    yield from import_benchmark("train_throughput")


def test_ac_rows_are_planned_and_labelled(bench: ModuleType) -> None:
    args = bench.build_parser().parse_args(
        [
            "--model", "dense", "--peers", "d9d,torchtitan", "--d9d-variants", "compiled",
            "--d9d-batches", "random", "--d9d-ac", "none,full,selective,selective-op,selective-mix",
            "--titan-variants", "compile", "--titan-ac", "none,full,selective",
        ]
    )  # fmt: skip
    rows = bench.plan(args)
    assert [(r.peer, r.ac) for r in rows] == [
        ("d9d", "none"), ("d9d", "full"), ("d9d", "selective"), ("d9d", "selective-op"),
        ("d9d", "selective-mix"),
        ("torchtitan", "none"), ("torchtitan", "full"), ("torchtitan", "selective"),
    ]  # fmt: skip
    assert rows[1].label == "d9d compiled, random, AC full"
    assert rows[0].label == "d9d compiled, random"
    assert rows[4].label == "d9d compiled, random, AC selective-mix"
    assert rows[6].label == "torchtitan 0.2.2 + per-block compile, AC full"
    assert all(bench.Row.parse(r.spec()) == r for r in rows)
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--d9d-ac", "sometimes"])


def test_torchtitan_rows_refuse_the_mixed_mode(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """torchtitan has no whole-layer + op-level mix: `--titan-ac` refuses it by name, and a row spec that
    names it anyway fails in the row with the reason (before any model is built)."""
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--titan-ac", "none,selective-mix"])
    assert "unknown ['selective-mix']" in capsys.readouterr().err
    from throughput import titan_peer

    job = SimpleNamespace(activation_checkpoint=SimpleNamespace(mode="none", selective_ac_option="2"))
    with pytest.raises(ValueError, match="torchtitan has no activation checkpointing that mixes"):
        titan_peer.activation_checkpoint(job, "selective-mix")
    titan_peer.activation_checkpoint(job, "selective-op")
    assert (job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option) == (
        "selective",
        "op",
    )


def test_ratios_compare_with_the_same_mode_and_without_checkpointing(bench: ModuleType) -> None:
    def result(peer: str, variant: str, ac: str, tps: float, peak: float) -> dict[str, object]:
        row = bench.Row("dense", peer, variant, "random", ac)
        return {**row.__dict__, "label": row.label, "tokens_per_s": tps, "peak_gib": peak, "mfu": 0.4}

    results = [
        result("d9d", "compiled", "none", 100.0, 20.0),
        result("d9d", "compiled", "full", 75.0, 8.0),
        result("torchtitan", "compile", "none", 90.0, 30.0),
        result("torchtitan", "compile", "full", 60.0, 10.0),
    ]
    bench.add_ratios(results)
    assert results[1]["x_no_ac"] == 0.75 and results[1]["mem_x_no_ac"] == 0.4
    assert results[1]["x_titan_compile"] == 75.0 / 60.0  # against torchtitan with full AC too
    assert "x_no_ac" not in results[0]
    assert "| d9d compiled, random, AC full | 75 |" in bench.table(results)
    assert "| 0.75x / 0.40x |" in bench.table(results)

    # a d9d mode torchtitan has no row for: no ratio against it, the rest as usual
    results.append(result("d9d", "compiled", "selective-mix", 88.0, 10.0))
    bench.add_ratios(results)
    assert "x_titan_compile" not in results[-1]
    assert results[-1]["x_no_ac"] == 0.88 and results[-1]["mem_x_no_ac"] == 0.5
    assert "| d9d compiled, random, AC selective-mix | 88 | 40.0% | 10.0 | nan | - |" in bench.table(results)


def test_d9d_jobs_validate_for_every_mode(bench: ModuleType, tmp_path: Path) -> None:
    from throughput import common, d9d_peer

    from d9d.engine.config import parse_config

    modes = {}
    for ac in common.AC_MODES:
        config = parse_config(d9d_peer.job("dense", "compiled", "random", 5, ac, run_dir=str(tmp_path)))
        modes[ac] = config.activation_checkpointing.model_dump(exclude_none=True)
    assert modes == {
        "none": {"mode": "none"},
        "full": {"mode": "full"},
        "selective": {"mode": "selective", "every": 2},
        "selective-op": {"mode": "selective", "ops": ("matmul", "attention")},
        "selective-mix": {"mode": "selective", "every": 2, "ops": ("matmul", "attention")},
    }
    compiles = {
        variant: parse_config(d9d_peer.job("dense", variant, "random", 5, run_dir=str(tmp_path))).compile
        for variant in ("compiled", "compiled-autotune", "eager")
    }
    assert compiles["compiled"].enabled and compiles["compiled"].mode == "default"
    assert (
        compiles["compiled-autotune"].enabled
        and compiles["compiled-autotune"].mode == "max-autotune-no-cudagraphs"
    )
    assert compiles["eager"].enabled is False


def test_a_row_subprocess_gets_the_shape_and_the_mode(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row runs in its own process, which parses the row back (here it stops at the CUDA check);
    `--batch` / `--seq` travel to it in the environment `throughput.common` reads on import."""
    args = bench.build_parser().parse_args(["--batch", "1", "--seq", "65536"])
    row = bench.Row("dense", "d9d", "compiled", "random", "full")
    result = bench.spawn(row, args, timeout=120)
    assert result["error"] == "RuntimeError: this benchmark needs CUDA", result

    seen: dict[str, object] = {}

    class Popen:
        def __init__(self, cmd: list[str], **kwargs: object) -> None:
            seen.update(cmd=cmd, **kwargs)
            self.pid = 0

        def wait(self, timeout: float) -> int:
            return 1

    monkeypatch.setattr(bench.subprocess, "Popen", Popen)
    bench.spawn(row, args, timeout=120)
    env = seen["env"]
    assert isinstance(env, dict) and env["D9D_BENCH_BATCH"] == "1" and env["D9D_BENCH_SEQ"] == "65536"
    assert row.spec() in seen["cmd"]  # type: ignore[operator]


def test_step_marks_time_each_step_to_the_next_start_with_the_hook_outside() -> None:
    """A d9d row's step runs from its start to the next step's start (`mark` closes the last one); the
    `between` hook runs after one step's end and before the next one's start, so its time counts in none."""
    from types import SimpleNamespace

    from throughput.common import StepMarks

    now = [0.0]
    calls: list[int] = []

    def between(step: int) -> None:
        calls.append(step)
        now[0] += 100.0  # a slow hook (a profiler start) between two steps

    marks = StepMarks(cuda=False, between=between, clock=lambda: now[0])
    for step, work in ((1, 2.0), (2, 1.0), (3, 0.5)):
        marks(SimpleNamespace(step=step))
        now[0] += work
    marks.mark(4)
    assert marks.durations() == {1: 2.0, 2: 1.0, 3: 0.5}
    assert calls == [1, 2, 3, 4]


def _counting_host_reads(fn: Callable[[], torch.Tensor], reads: list[str]) -> torch.Tensor:
    """`fn()`, noting each `Tensor.cpu()` call in `reads`."""
    cpu = torch.Tensor.cpu

    def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        reads.append("Tensor.cpu")
        return cpu(t, *args, **kwargs)

    torch.Tensor.cpu = counted  # type: ignore[method-assign]
    try:
        return fn()
    finally:
        torch.Tensor.cpu = cpu  # type: ignore[method-assign]


def _tiny_moe() -> tuple[torch.nn.Module, torch.Tensor]:
    """A two-layer Qwen3-MoE in float64 and a [3, 10] batch of token ids."""
    from d9d.models.qwen3_moe import Qwen3MoEConfig, Qwen3MoEModel

    torch.manual_seed(0)
    arch = {"vocab_size": 32, "hidden_size": 16, "num_layers": 2, "num_attention_heads": 2, "num_kv_heads": 1}
    config = Qwen3MoEConfig(
        **arch,
        head_dim=8,
        intermediate_size=8,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        grouped_mm="eager",
    )
    return Qwen3MoEModel(config).double(), torch.randint(0, 32, (3, 10))


def _one_rank_exchange(env: RankEnv) -> None:
    from throughput import d9d_peer

    from d9d.modules.moe import MoELayer
    from d9d.parallel.expert import AllToAllMoECommunication

    local, ids = _tiny_moe()
    want = local(input_ids=ids)
    for tokens in (None, ids.numel()):  # `compiled-a2a`, then `compiled-a2a-static`
        swapped = copy.deepcopy(local)
        d9d_peer._exchange_on_one_rank([swapped], tokens)
        layers = [m for m in swapped.modules() if isinstance(m, MoELayer)]
        assert len(layers) == 2
        assert all(isinstance(m.communication, AllToAllMoECommunication) for m in layers)
        reads: list[str] = []
        got = _counting_host_reads(lambda m=swapped: m(input_ids=ids), reads)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        # the reading exchange reads its split sizes once per layer; the static one never, and no copy
        # overflowed its capacity (every one of the 3 x 10 tokens' 2 copies stays on this rank)
        assert len(reads) == (2 if tokens is None else 0), reads
        if tokens is not None:
            for layer in layers:
                record = layer.communication.capacity.take()
                assert record is not None and record.tolist() == [0.0, 60.0]


def test_the_one_rank_exchange_variant_puts_moe_layers_behind_the_all_to_all(bench: ModuleType) -> None:
    """`compiled-a2a` / `compiled-a2a-static`: every MoE layer exchanges through a one-rank all-to-all,
    giving the local layer's outputs; the static one without reading its split sizes."""
    run_distributed(_one_rank_exchange, 1, timeout=60)


def test_the_breaks_variant_runs_the_local_dispatch_and_combine_between_compiled_pieces(
    bench: ModuleType,
) -> None:
    """`compiled-breaks`: the local layers' outputs, with dynamo breaking the graph at every dispatch and
    combine (as it does at the exchange's)."""
    from throughput import d9d_peer
    from torch._dynamo.utils import counters

    local, ids = _tiny_moe()
    want = local(input_ids=ids)
    swapped = copy.deepcopy(local)
    d9d_peer._local_with_breaks([swapped])
    torch.testing.assert_close(swapped(input_ids=ids), want, rtol=0, atol=0)
    torch._dynamo.reset()
    counters.clear()
    torch.testing.assert_close(torch.compile(swapped, backend="aot_eager")(input_ids=ids), want)
    reasons = " ".join(counters["graph_break"])
    assert "EagerLocal.dispatch" in reasons and "EagerLocal.combine" in reasons, reasons
