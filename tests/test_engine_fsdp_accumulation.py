"""FSDP under gradient accumulation without pipelining (`fsdp.reduce_every`): the engine's step, against one
process, and what each setting does to FSDP's collectives.

- `reduce_every` `auto` (the tiny models stay gathered, so once per step), `microbatch`, `step` on units
  that would otherwise reshard, `auto` on units that reshard (every microbatch): dense FSDP 2, MoE FSDP 2 ×
  EP 2 (the experts' gradients reach the synchronizer per microbatch, the dense ones once per step) and
  HSDP 2 × 2 (the replica all-reduce from FSDP's post-backward, once per step), and `auto` under TP 2 × FSDP
  2 and CP 2 × FSDP 2: losses over 3 AdamW steps equal one process on the same global batches (2 or 4
  microbatches per rank and step).
- Observed from outside FSDP: per step, reducing once issues exactly half the reduce-scatters and half the
  all-gathers of reducing every microbatch (2 microbatches), and at least one of each.
- An eval section after every step of FSDP 2 reducing once per step (its forwards gather the units anew
  between two steps): the eval losses and the training losses equal one process's with the same eval.
- `gradient_manager.grad_dtype` wider than FSDP's accumulation: `auto` reduces every microbatch (the
  synchronizer then accumulates in grad_dtype) and logs why, `step` is refused naming the setting (the job
  config refuses it earlier for the built-in models: tests/test_engine_config.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import parse_config
from d9d.engine.launch import run_rank
from d9d.engine.runtime import MetricPoint, RankRuntime
from tests.engine_fixtures import make_hf_qwen3, make_hf_qwen3_moe
from tests.harness import RankEnv, run_distributed
from tests.test_parallel_fsdp_settings import GATHER, SCATTER, counting_collectives

STEPS = 3


def _job(
    tmp: Path, name: str, mesh: dict[str, int], fsdp: dict[str, Any], global_batch: int
) -> dict[str, Any]:
    moe = name.startswith("moe")
    options: dict[str, Any] = {"source_checkpoint": str(tmp / ("hf-moe" if moe else "hf-dense"))}
    if fsdp:
        options["parallel"] = {"fsdp": fsdp}
    evaluation: dict[str, Any] = {}
    if name.endswith("-eval"):  # evaluates after every step
        data = {"provider": "tests.engine_fixtures:GlobalIndexData"}
        evaluation["eval"] = {"data": data, "batch_size": 4, "batches": 2, "period": 1}
    return {
        **evaluation,
        "run": {"name": name, "dir": str(tmp / name)},
        "mesh": mesh,
        "batching": {"global_batch_size": global_batch, "microbatch_size": 2},
        "trainer": {"total_steps": STEPS},
        "logging": {"progress_bar": "off", "period": 1},
        "checkpointing": {"save_at_end": False},
        "model": {"provider": "qwen3_moe" if moe else "qwen3", "options": options},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
    }


def _runs(env: RankEnv, runs: list[tuple[str, dict[str, int], dict[str, Any], int]]) -> None:
    for name, mesh, fsdp, global_batch in runs:
        config = parse_config(_job(env.tmp_dir, name, mesh, fsdp, global_batch))
        runtime = RankRuntime(
            rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=config.run_dir
        )
        points: list[MetricPoint] = []
        with counting_collectives(GATHER, SCATTER) as counts:
            result = run_rank(config, runtime, LocalRunReporter(config.checkpoint_dir, 1, points.append))
        if env.rank == 0:
            evals = {p.step: p.values["eval/loss"] for p in points if p.kind == "eval"}
            torch.save({"losses": list(result.losses), "evals": evals, **counts}, env.tmp_dir / f"{name}.pt")


def _load(tmp: Path, name: str) -> dict[str, Any]:
    return torch.load(tmp / f"{name}.pt")  # type: ignore[no-any-return]


def _assert_like(tmp: Path, name: str, reference: str) -> None:
    losses = torch.tensor(_load(tmp, name)["losses"])
    want = torch.tensor(_load(tmp, reference)["losses"])
    assert len(losses) == STEPS and losses[-1] < losses[0], name
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6, msg=name)


def _assert_halves(tmp: Path, once: str, every: str) -> None:
    """Reducing once per step issues half the collectives of reducing each of 2 microbatches."""
    a, b = _load(tmp, once), _load(tmp, every)
    for kind in (GATHER, SCATTER):
        assert a[kind] > 0 and 2 * a[kind] == b[kind], (once, every, kind, a[kind], b[kind])


RESHARDING = {"keep_gathered_gib": 0}  # the tiny models' units then reshard after forward


@pytest.mark.distributed
def test_reducing_once_per_step_trains_like_one_process_with_half_the_collectives(tmp_path: Path) -> None:
    make_hf_qwen3(tmp_path / "hf-dense", num_layers=4)
    make_hf_qwen3_moe(tmp_path / "hf-moe", num_layers=4)
    one = [("one", {}, {}, 8), ("moe-one", {}, {}, 8), ("one-16", {}, {}, 16), ("one-eval", {}, {}, 8)]
    run_distributed(_runs, 1, one, tmp_dir=tmp_path, timeout=300)
    fsdp2 = {"data_parallel_shard": 2}
    two = [
        ("fsdp2-auto", fsdp2, {}, 8),
        ("fsdp2-microbatch", fsdp2, {"reduce_every": "microbatch"}, 8),
        ("fsdp2-resharding-step", fsdp2, {**RESHARDING, "reduce_every": "step"}, 8),
        ("fsdp2-resharding-auto", fsdp2, RESHARDING, 8),
        ("moe-fsdp2xep2-auto", {**fsdp2, "expert_parallel": 2}, {}, 8),
        ("moe-fsdp2xep2-microbatch", {**fsdp2, "expert_parallel": 2}, {"reduce_every": "microbatch"}, 8),
        ("fsdp2-auto-eval", fsdp2, {}, 8),
    ]
    run_distributed(_runs, 2, two, tmp_dir=tmp_path, timeout=600)
    hsdp = {"data_parallel_replicate": 2, "data_parallel_shard": 2}
    four = [
        ("hsdp-auto", hsdp, {}, 16),
        ("hsdp-microbatch", hsdp, {"reduce_every": "microbatch"}, 16),
        # FSDP over tensor-parallel shards, and over the context-parallel ranks of a split sequence
        ("tp2xfsdp2-auto-16", {"tensor_parallel": 2, "data_parallel_shard": 2}, {}, 16),
        ("cp2xfsdp2-auto-16", {"context_parallel_shard": 2, "data_parallel_shard": 2}, {}, 16),
    ]
    run_distributed(_runs, 4, four, tmp_dir=tmp_path, timeout=600)
    for name, *_ in two + four:
        reference = (
            "moe-one" if name.startswith("moe") else "one-16" if "16" in name or "hsdp" in name else "one"
        )
        _assert_like(tmp_path, name, reference)
    # evaluating between the steps changes no training loss, and evaluates what one process does
    _assert_like(tmp_path, "one-eval", "one")  # (fsdp2-auto-eval against one: in the loop above)
    evals, want = _load(tmp_path, "fsdp2-auto-eval")["evals"], _load(tmp_path, "one-eval")["evals"]
    assert sorted(evals) == sorted(want) == list(range(1, STEPS + 1)), (evals, want)
    torch.testing.assert_close(
        torch.tensor([evals[s] for s in sorted(want)]),
        torch.tensor([want[s] for s in sorted(want)]),
        rtol=1e-5,
        atol=0,
    )
    _assert_halves(tmp_path, "fsdp2-auto", "fsdp2-microbatch")
    _assert_halves(tmp_path, "moe-fsdp2xep2-auto", "moe-fsdp2xep2-microbatch")
    _assert_halves(tmp_path, "hsdp-auto", "hsdp-microbatch")
    # Resharding units gather again in backward: reducing every microbatch (auto over the size limit) issues
    # more all-gathers than keeping them gathered through the step, and twice its reduce-scatters.
    step, auto = _load(tmp_path, "fsdp2-resharding-step"), _load(tmp_path, "fsdp2-resharding-auto")
    assert 2 * step[SCATTER] == auto[SCATTER] and 2 * step[GATHER] < auto[GATHER], (step, auto)


@contextlib.contextmanager
def _logged(name: str) -> Iterator[list[str]]:
    lines: list[str] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, sink = logging.getLogger(name), Sink()
    level = logger.level
    logger.addHandler(sink)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(sink)
        logger.setLevel(level)


def _grad_dtype_cases(env: RankEnv) -> None:
    from d9d.core import DeviceMeshParameters, DistributedContext
    from d9d.engine.step import once_per_step_sharding
    from d9d.models.qwen3 import parallelize_qwen3
    from d9d.parallel import GradSyncConfig
    from d9d.parallel.fsdp import FSDPConfig
    from d9d.parallel.plans import ParallelPlanConfig
    from tests.test_parallel_qwen3 import _dense

    ctx = DistributedContext.create(DeviceMeshParameters(data_parallel_shard=2), backend="gloo")
    wide, same = GradSyncConfig(grad_dtype="float64"), GradSyncConfig()
    for reduce_every in ("auto", "step", "microbatch"):
        model = _dense()  # float32
        parallelize_qwen3(model, ctx, ParallelPlanConfig(fsdp=FSDPConfig(reduce_every=reduce_every)))
        assert once_per_step_sharding(model, 1, same) is None, reduce_every  # nothing accumulates
        chosen = once_per_step_sharding(model, 2, same)
        assert (chosen is not None) == (reduce_every != "microbatch"), reduce_every
        if reduce_every == "step":
            with pytest.raises(ValueError, match=r"fsdp\.reduce_every 'step'.*narrower than.*'float64'"):
                once_per_step_sharding(model, 2, wide)
        else:
            with _logged("d9d.engine.step") as said:
                assert once_per_step_sharding(model, 2, wide) is None, reduce_every
            # auto says why it reduces every microbatch and how to get once per step back
            assert (reduce_every == "auto") == any("set fsdp.reduce_dtype" in line for line in said), said
    widened = _dense()
    config = FSDPConfig(reduce_every="step", reduce_dtype="float32")
    parallelize_qwen3(widened, ctx, ParallelPlanConfig(fsdp=config))
    assert once_per_step_sharding(widened, 2, GradSyncConfig(grad_dtype="float32")) is not None


@pytest.mark.distributed
def test_a_wider_grad_dtype_keeps_per_microbatch_reduction_under_auto_and_refuses_step() -> None:
    run_distributed(_grad_dtype_cases, 2, timeout=120)
