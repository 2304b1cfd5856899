"""What may change on resume, and what it does (docs/engine.md, "What may change on resume"): each row of
the table against a run. LRs are checked against the schedule computed by hand, not by the scheduler."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import parse_config
from d9d.engine.identity import IdentityError
from d9d.engine.resume import ResumeError, check_resume
from tests.harness import RankEnv, run_distributed
from tests.test_checkpoint_trust import config_dict

pytestmark = pytest.mark.distributed

# Warm up over 2 steps, then a cosine from 1 to 0.1 over the rest of the run.
SCHEDULE = {
    "provider": "piecewise",
    "options": {
        "initial_multiplier": 0.0,
        "phases": [
            {"kind": "steps", "steps": 2, "target": 1.0, "curve": {"type": "linear"}},
            {"kind": "rest", "target": 0.1, "curve": {"type": "cosine"}},
        ],
    },
}


def multiplier(step: int, total: int) -> float:
    """The schedule above by hand: the LR of step `step + 1` is base × multiplier(step, total)."""
    if step < 2:
        return step / 2
    t = min(1.0, (step - 2) / (total - 2))
    return 0.1 + 0.9 * (1 + math.cos(math.pi * t)) / 2


def job(run_dir: Path, total: int, lr: float, schedule: bool = True, **sections: Any) -> dict[str, Any]:
    raw = config_dict(run_dir, total_steps=total, optimizer={"options": {"lr": lr}}, **sections)
    raw["checkpointing"] = {"period": 6, "save_at_end": False}
    if schedule:
        raw["lr_scheduler"] = SCHEDULE
    return raw


def train_recording(env: RankEnv, raw: dict[str, Any], out: str) -> None:
    """Train; keep the LR each step ran with, the warnings logged and the metric points reported."""
    from d9d.core.context import DistributedContext
    from d9d.engine.events import EventBus, StepStarted
    from d9d.engine.trainer import Trainer

    config = parse_config(raw)
    ctx = DistributedContext.create(config.mesh)
    points: list[Any] = []
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("d9d").addHandler(handler)
    events = EventBus()
    reporter = LocalRunReporter(config.checkpoint_dir, 3, metrics_sink=points.append)
    notices: list[str] = []
    reporter.notice = notices.append  # type: ignore[attr-defined]  # what Ray's reporter has: the console
    trainer = Trainer(config, ctx, reporter, events)
    lrs: dict[int, float] = {}
    events.subscribe(StepStarted, lambda e: lrs.__setitem__(e.step, trainer.parts.optimizer.lr))
    trainer.setup()
    result = trainer.train()
    resume_points = [(p.step, p.values) for p in points if any(k.startswith("resume/") for k in p.values)]
    torch.save(
        {
            "lrs": lrs,
            "warnings": warnings,
            "notices": notices,
            "points": resume_points,
            "losses": list(result.losses),
        },
        env.tmp_dir / out,
    )


def _run(raw: dict[str, Any], tmp: Path, out: str) -> dict[str, Any]:
    run_distributed(train_recording, 1, raw, out, tmp_dir=tmp)
    result: dict[str, Any] = torch.load(tmp / out)
    return result


@pytest.fixture
def committed(tmp_path: Path) -> Path:
    """A 6-step run at base LR 3e-3 (its schedule planned for 6 steps), committed at step 6."""
    run_dir = tmp_path / "run"
    first = _run(job(run_dir, 6, 3e-3), tmp_path, "first.pt")
    assert first["lrs"][6] == pytest.approx(3e-3 * multiplier(5, 6))
    return run_dir


def test_a_new_base_lr_and_more_steps_apply_from_the_resume_step_and_are_announced(
    committed: Path, tmp_path: Path
) -> None:
    second = _run(job(committed, 10, 1e-2), tmp_path, "second.pt")
    # From step 7 on: the new base LR on the schedule re-planned for 10 steps (the issue saw 3e-4 here).
    for step in range(7, 11):
        assert second["lrs"][step] == pytest.approx(1e-2 * multiplier(step - 1, 10), rel=1e-9), step
    notes = "\n".join(second["warnings"])
    assert (
        "resume at step 6: base LR 0.003 -> 0.01 (optimizer.options.lr): the new base LR applies from step 7"
        in notes
    )
    assert "trainer.total_steps 6 -> 10: the LR schedule is re-planned for 10 steps from step 7" in notes
    said = [w[w.index("resume at step") :] for w in second["warnings"] if "resume at step" in w]
    assert said == second["notices"] and len(said) == 3  # the launcher's console hears the same
    old_plan, new_plan = 3e-3 * multiplier(6, 6), 1e-2 * multiplier(6, 10)
    assert f"the LR for step 7 is {new_plan:.3g} (the commit's plan: {old_plan:.3g})" in notes
    ((step, values),) = second["points"]  # the tracker hears it too, at the first step of the launch
    assert step == 7 and values["resume/base_lr"] == 1e-2 and values["resume/total_steps"] == 10
    assert values["resume/lr"] == pytest.approx(new_plan) and values["resume/lr_before"] == pytest.approx(
        old_plan
    )


def test_more_steps_alone_re_plan_the_schedule_with_the_same_base(committed: Path, tmp_path: Path) -> None:
    second = _run(job(committed, 12, 3e-3), tmp_path, "second.pt")
    for step in range(7, 13):
        assert second["lrs"][step] == pytest.approx(3e-3 * multiplier(step - 1, 12), rel=1e-9), step
    notes = "\n".join(second["warnings"])
    assert "trainer.total_steps 6 -> 12: the LR schedule is re-planned" in notes and "base LR" not in notes


def test_a_new_lr_without_a_scheduler_applies_from_the_resume_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _run(job(run_dir, 6, 3e-3, schedule=False), tmp_path, "first.pt")
    second = _run(job(run_dir, 8, 5e-3, schedule=False), tmp_path, "second.pt")
    assert [second["lrs"][s] for s in (7, 8)] == [5e-3, 5e-3]
    assert any("base LR 0.003 -> 0.005" in w for w in second["warnings"])


def test_an_unchanged_resume_says_nothing_and_is_bitwise(tmp_path: Path) -> None:
    """10 steps committed only at step 6: launching the same config again continues from 6, silently, and
    trains steps 7-10 exactly as the first launch did."""
    run_dir = tmp_path / "run"
    first = _run(job(run_dir, 10, 3e-3), tmp_path, "first.pt")
    again = _run(job(run_dir, 10, 3e-3), tmp_path, "again.pt")
    assert sorted(again["lrs"]) == [7, 8, 9, 10]
    assert not [w for w in again["warnings"] if "resume at step" in w] and not again["points"]
    assert again["losses"] == first["losses"]


# -- data layout and architecture: refused by the driver's check, before anything starts -------------------


def _text_job(tmp_path: Path, microbatch: int, bucketing: bool, num_layers: int = 1) -> dict[str, Any]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} {'x' * (i % 7)}\n" for i in range(64)))
    arch = {
        "vocab_size": 259,
        "hidden_size": 16,
        "num_layers": num_layers,
        "num_attention_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
        "intermediate_size": 32,
    }
    options: dict[str, Any] = {"dataset": {"paths": [str(corpus)], "max_length": 16}}
    if bucketing:
        options["bucketing_buffer"] = 8
    return {
        "run": {"name": "layout", "dir": str(tmp_path / "run")},
        "batching": {"global_batch_size": 4, "microbatch_size": microbatch},
        "trainer": {"total_steps": 2},
        "model": {"provider": "qwen3", "options": {"architecture": arch}},
        "data": {"provider": "text", "options": options},
        "logging": {"progress_bar": "off"},
    }


def _train_text(env: RankEnv, raw: dict[str, Any]) -> None:
    from tests.test_checkpoint_trust import train

    train(env, raw, "text.pt")


@pytest.mark.parametrize("bucketing", [True, False])
def test_a_microbatch_change_is_continued_exactly_or_refused_before_anything_starts(
    tmp_path: Path, bucketing: bool
) -> None:
    run_distributed(_train_text, 1, _text_job(tmp_path, 2, bucketing), tmp_dir=tmp_path)
    resumed = _text_job(tmp_path, 1, bucketing)
    resumed["trainer"] = {"total_steps": 4}
    if not bucketing:
        decision = check_resume(parse_config(resumed))  # the position is one of the global sample stream
        assert decision.action == "resume" and decision.step == 2
        run_distributed(_train_text, 1, resumed, tmp_dir=tmp_path)
        return
    with pytest.raises(
        ResumeError,
        match=r"the data provider cannot continue the commit's data position after batching.microbatch_size "
        r"2 -> 1: cannot resume buffer-sorted dataset from this state: pack_size: checkpoint has 2, this "
        r"run has 1",
    ):
        check_resume(parse_config(resumed))


def test_an_architecture_change_is_refused(tmp_path: Path) -> None:
    run_distributed(_train_text, 1, _text_job(tmp_path, 2, False), tmp_dir=tmp_path)
    wider = _text_job(tmp_path, 2, False, num_layers=2)
    wider["trainer"] = {"total_steps": 4}
    with pytest.raises(IdentityError, match=r"model.options.architecture.num_layers: 1 -> 2"):
        check_resume(parse_config(wider))
