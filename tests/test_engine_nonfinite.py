"""The non-finite guard (`trainer.on_nonfinite`, d9d.engine.nonfinite) against runs whose data plug-in
injects a NaN loss, an infinite loss or an infinite gradient at chosen steps (`tests.nonfinite_fixtures`).

References are independent runs: a skipped step must leave parameters and optimizer state bitwise as they
were, and the whole run must equal one that never saw those batches; a rollback must equal one that never
saw the batches since the commit it rolled back to."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.checkpoint import LocalRunReporter, verify_manifest
from d9d.engine.config import ConfigError, parse_config
from d9d.engine.nonfinite import NonFiniteError
from tests.harness import DistributedTestFailure, RankEnv, run_distributed

pytestmark = pytest.mark.distributed


def job(run_dir: Path, total_steps: int, **sections: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "run": {"name": "nonfinite", "dir": str(run_dir)},
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": total_steps},
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider"},
        "data": {"provider": "tests.nonfinite_fixtures:PoisonedData", "options": {}},
        "task": {"provider": "tests.nonfinite_fixtures:PoisonTask"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-2}},
        "checkpointing": {"save_at_end": False},
        "logging": {"progress_bar": "off"},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part, cloned (a DTensor under FSDP: its shard, comparable without a process group)."""
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _state(trainer: Any) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor of the rank, cloned."""
    out = {f"param.{n}": _local(p) for m in trainer.modules for n, p in m.named_parameters()}
    for i, optimizer in enumerate(trainer.parts.optimizer.optimizers.values()):
        for j, state in enumerate(optimizer.state.values()):
            out.update({f"optim{i}.{j}.{k}": _local(v) for k, v in state.items() if torch.is_tensor(v)})
    return out


def train_watching(env: RankEnv, raw: dict[str, Any], watch: list[int]) -> None:
    """Train, keeping the state before and after each step in `watch`, and the final parameters."""
    from d9d.core.context import DistributedContext
    from d9d.engine.events import EventBus, StepFinished, StepSkipped, StepStarted
    from d9d.engine.trainer import Trainer

    config = parse_config(raw)
    ctx = DistributedContext.create(config.mesh)
    events = EventBus()
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 3), events)
    seen: dict[str, Any] = {"before": {}, "after": {}, "skipped": []}

    def started(event: StepStarted) -> None:
        if event.step in watch:
            seen["before"][event.step] = _state(trainer)

    def finished(event: StepFinished) -> None:
        if event.step in watch:
            seen["after"][event.step] = _state(trainer)

    events.subscribe(StepStarted, started)
    events.subscribe(StepFinished, finished)
    events.subscribe(StepSkipped, lambda e: seen["skipped"].append((e.step, e.reason, e.rolled_back_to)))
    trainer.setup()
    result = trainer.train()
    seen["losses"] = list(result.losses)
    seen["steps"] = result.steps
    seen["final"] = {n: _local(p) for m in trainer.modules for n, p in m.named_parameters()}
    torch.save(seen, env.tmp_dir / f"seen-{env.rank}.pt")


def _run(raw: dict[str, Any], tmp: Path, watch: Sequence[int] = (), world: int = 1) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    run_distributed(train_watching, world, raw, list(watch), tmp_dir=tmp)
    seen: dict[str, Any] = torch.load(tmp / "seen-0.pt")
    return seen


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("poison", "fused", "shards"),
    [
        ("nan", False, 1),
        ("inf", False, 1),
        ("grad_inf", False, 1),
        ("nan", True, 1),
        ("grad_inf", True, 1),
        ("nan", True, 2),
    ],
)
def test_skip_leaves_state_bitwise_and_equals_a_run_without_that_batch(
    tmp_path: Path, poison: str, fused: bool, shards: int
) -> None:
    """`fused`: fused AdamW, whose update is queued before the host reads the step's values and skips itself
    on the device (`found_inf`); the others are stepped by the host after the read. `shards`: FSDP over that
    many ranks (the optimizer then steps DTensor shards)."""
    optimizer = {"options": {"lr": 1e-2, "fused": fused}}
    mesh = {"data_parallel_shard": shards}
    skipping = job(
        tmp_path / "run",
        6,
        trainer={"on_nonfinite": "skip"},
        data={"options": {"poison": {3: poison}}},
        optimizer=optimizer,
        mesh=mesh,
    )
    seen = _run(skipping, tmp_path / "skip", watch=[3, 4], world=shards)
    (step, reason, rolled_back_to) = seen["skipped"][0]
    assert len(seen["skipped"]) == 1 and step == 3 and rolled_back_to is None
    what = "gradient norm (" if poison == "grad_inf" else f"loss ({float(poison)})"
    assert reason.startswith(f"step 3: non-finite {what}"), reason
    # The skipped step changed nothing: parameters and every optimizer state tensor are bitwise the same.
    assert _bitwise_equal(seen["before"][3], seen["after"][3])
    assert not _bitwise_equal(seen["before"][4], seen["after"][4])  # the next step trains again
    assert seen["steps"] == 6 and math.isnan(seen["losses"][2]) != (poison != "nan")

    # Independent reference: the same stream without batch 3, one step fewer.
    reference = _run(
        job(tmp_path / "ref", 5, data={"options": {"drop": [3]}}, optimizer=optimizer, mesh=mesh),
        tmp_path / "ref",
        world=shards,
    )
    assert _bitwise_equal(seen["final"], reference["final"])
    kept = seen["losses"][:2] + seen["losses"][3:]
    assert kept == reference["losses"]


def test_stop_is_the_default_and_names_the_step_and_rank_and_keeps_the_last_commit(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    raw = job(
        run_dir,
        8,
        mesh={"data_parallel_replicate": 2},
        checkpointing={"period": 2, "save_at_end": True},
        data={"options": {"poison": {5: "nan"}, "ranks": [1]}},
    )
    assert parse_config(raw).trainer.on_nonfinite == "stop"
    with pytest.raises(DistributedTestFailure) as failure:
        _run(raw, tmp_path / "stop", world=2)
    message = str(failure.value)
    assert "NonFiniteError: step 5: non-finite loss (nan) on rank 1" in message, message
    assert "stopping (trainer.on_nonfinite=stop)" in message
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text() == "step-00000004"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002", "step-00000004"]
    verify_manifest(root / "step-00000004")


def test_stop_on_a_finite_loss_with_an_infinite_gradient_names_the_parameter(tmp_path: Path) -> None:
    raw = job(tmp_path / "run", 4, data={"options": {"poison": {2: "grad_inf"}}})
    with pytest.raises(DistributedTestFailure) as failure:
        _run(raw, tmp_path / "stop")
    message = str(failure.value)
    assert "step 2: non-finite gradient norm (" in message and "first in embed.weight on rank 0" in message
    assert "non-finite loss" not in message


def test_rollback_restores_the_commit_and_skips_the_batches_since(tmp_path: Path) -> None:
    raw = job(
        tmp_path / "run",
        8,
        trainer={"on_nonfinite": "rollback"},
        checkpointing={"period": 4},
        data={"options": {"poison": {6: "inf"}}},
    )
    seen = _run(raw, tmp_path / "rollback")
    assert [(s, r) for s, _, r in seen["skipped"]] == [(6, 4)]
    # Back to step 4, batches 5 and 6 skipped: the run equals one whose stream never had them (a skip
    # would have kept batch 5's update).
    reference = _run(job(tmp_path / "ref", 8, data={"options": {"drop": [5, 6]}}), tmp_path / "ref")
    assert seen["steps"] == 8
    assert seen["losses"] == reference["losses"]
    assert _bitwise_equal(seen["final"], reference["final"])


def test_skips_past_the_limit_stop(tmp_path: Path) -> None:
    raw = job(
        tmp_path / "run",
        6,
        trainer={"on_nonfinite": "skip", "max_nonfinite_steps": 2},
        data={"options": {"poison": {2: "nan", 3: "inf", 5: "nan"}}},
    )
    with pytest.raises(
        DistributedTestFailure,
        match=r"step 5: non-finite loss \(nan\) on rank 0; .*; stopping "
        r"\(more than trainer.max_nonfinite_steps=2 in this attempt\)",
    ):
        _run(raw, tmp_path / "limit")


def test_non_finite_weights_are_never_committed(tmp_path: Path) -> None:
    """An update from finite gradients that overflows the weights: the save refuses, nothing commits."""
    run_dir = tmp_path / "run"
    raw = job(
        run_dir,
        3,
        optimizer={
            "provider": "tests.nonfinite_fixtures:OverflowingOptimizer",
            "options": {"overflow_at": 2},
        },
        checkpointing={"period": 1},
    )
    with pytest.raises(DistributedTestFailure) as failure:
        _run(raw, tmp_path / "weights")
    message = str(failure.value)
    assert "NonFiniteError: step 2: the weights are not finite (embed.weight on rank 0)" in message, message
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text() == "step-00000001"
    assert [p.parent.name for p in root.glob("step-*/manifest.json")] == ["step-00000001"]


def test_config_validates_the_setting(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"trainer.on_nonfinite: Input should be 'stop', 'skip' or 'rollback'"
    ):
        parse_config(job(tmp_path, 2, trainer={"on_nonfinite": "ignore"}))
    with pytest.raises(ConfigError, match=r"rollback .* needs periodic commits: set checkpointing.period"):
        parse_config(job(tmp_path, 2, trainer={"on_nonfinite": "rollback"}))
    with pytest.raises(ConfigError, match=r"trainer.max_nonfinite_steps: Input should be greater"):
        parse_config(job(tmp_path, 2, trainer={"max_nonfinite_steps": 0}))


def test_a_non_finite_stop_is_not_retried() -> None:
    from d9d.cluster.control.failure import is_retryable

    assert not is_retryable(NonFiniteError("step 3: ...", 3, [1]))
