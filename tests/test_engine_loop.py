"""The training loop on user-style providers: exact resume, accumulation equivalence, crash-safe commits."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.checkpoint import LocalRunReporter, read_latest
from d9d.engine.config import parse_config
from d9d.engine.launch import run_rank
from d9d.engine.runtime import RankRuntime
from tests.harness import RankEnv, run_distributed

pytestmark = pytest.mark.distributed


def _config(run_dir: Path, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "run": {"name": "loop", "dir": str(run_dir)},
        "batching": {"global_batch_size": 8, "microbatch_size": 4},
        "trainer": {"total_steps": 20},
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider"},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "tests.engine_fixtures:TokenCETask"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-2, "weight_decay": 0.01}},
        "checkpointing": {"period": 5, "keep_last": 2},
        "logging": {"progress_bar": "off"},
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        config[section] = {**config.get(section, {}), name: value}
    return config


def _train(
    env: RankEnv, run_dir: Path, out: str, overrides: dict[str, Any], dp_override: int | None = None
) -> None:
    config = parse_config(_config(run_dir, **overrides))
    runtime = RankRuntime(
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.rank,
        run_dir=run_dir,
        data_parallel_override=dp_override,
    )
    reporter = LocalRunReporter(config.checkpoint_dir, config.checkpointing.keep_last)
    result = run_rank(config, runtime, reporter)
    if env.rank == 0:
        torch.save({"losses": list(result.losses), "steps": result.steps}, env.tmp_dir / out)


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """Read model tensors of the latest committed checkpoint (DCP) without any process group."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    latest = read_latest(run_dir / "checkpoints")
    assert latest is not None
    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(str(latest)),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    return dict(state["app"]["model"])


def test_exact_resume_is_bitwise(tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_distributed(_train, 1, straight, "a.pt", {}, tmp_dir=tmp_path)
    run_distributed(_train, 1, split, "b1.pt", {"trainer__total_steps": 10}, tmp_dir=tmp_path)
    run_distributed(_train, 1, split, "b2.pt", {}, tmp_dir=tmp_path)
    a = torch.load(tmp_path / "a.pt")
    b1, b2 = torch.load(tmp_path / "b1.pt"), torch.load(tmp_path / "b2.pt")
    assert a["steps"] == 20 and b1["steps"] == 10 and b2["steps"] == 20
    assert b2["losses"] == a["losses"], "resumed losses differ from the straight run"
    assert a["losses"][-1] < a["losses"][0] * 0.8, a["losses"]
    pa, pb = _final_params(straight), _final_params(split)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    # keep_last=2: only the two newest committed steps remain
    assert sorted(p.name for p in (straight / "checkpoints").glob("step-*")) == [
        "step-00000015",
        "step-00000020",
    ]


def test_gradient_accumulation_gives_equal_updates(tmp_path: Path) -> None:
    """Global batch 8 as 8x1, 4x2 and 2x4 microbatches: same losses and parameters (float tolerance)."""
    for mb in (8, 4, 2):
        run_distributed(
            _train,
            1,
            tmp_path / f"mb{mb}",
            f"mb{mb}.pt",
            {"batching__microbatch_size": mb, "trainer__total_steps": 3, "checkpointing__period": None},
            tmp_dir=tmp_path,
        )
    ref = torch.load(tmp_path / "mb8.pt")["losses"]
    ref_params = _final_params(tmp_path / "mb8")
    for mb in (4, 2):
        losses = torch.load(tmp_path / f"mb{mb}.pt")["losses"]
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref), rtol=1e-6, atol=0), (mb, losses, ref)
        params = _final_params(tmp_path / f"mb{mb}")
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=1e-5, atol=1e-6)


_CRASH_SCRIPT = """
import os, sys
import torch.distributed.checkpoint.state_dict_saver as saver
from d9d.engine import checkpoint as ckpt

real_save = ckpt.dcp_save
def dying_save(*args, **kwargs):
    if os.environ.get("D9D_TEST_DIE") and "step-00000010" in str(kwargs.get("checkpoint_id")):
        real_save(*args, **kwargs)   # the shards hit the disk ...
        os._exit(9)                  # ... and the process dies before the commit
    return real_save(*args, **kwargs)
ckpt.dcp_save = dying_save
from d9d.engine.launch import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_during_checkpoint_keeps_previous_latest(tmp_path: Path) -> None:
    import yaml

    run_dir = tmp_path / "run"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(_config(run_dir, trainer__total_steps=12)))
    env = {**os.environ, "D9D_TEST_DIE": "1", "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH_SCRIPT, str(cfg)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    root = run_dir / "checkpoints"
    latest = read_latest(root)
    assert latest is not None and latest.name == "step-00000005"
    assert (root / "step-00000010").exists() and not (root / "step-00000010" / "manifest.json").exists()
    # The previous checkpoint is loadable: resuming finishes the run and replaces the partial step.
    env.pop("D9D_TEST_DIE")
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH_SCRIPT, str(cfg)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_latest(root).name == "step-00000012"
    assert (root / "step-00000010" / "manifest.json").exists()


def test_data_parallel_matches_single_process_and_resumes_on_fewer_ranks(tmp_path: Path) -> None:
    dp2 = {"mesh__data_parallel_replicate": 2}
    run_distributed(
        _train, 1, tmp_path / "single", "single.pt", {"checkpointing__period": 10}, tmp_dir=tmp_path
    )
    run_distributed(
        _train, 2, tmp_path / "dp2", "dp2.pt", {**dp2, "checkpointing__period": 10}, tmp_dir=tmp_path
    )
    single = torch.tensor(torch.load(tmp_path / "single.pt")["losses"])
    both = torch.tensor(torch.load(tmp_path / "dp2.pt")["losses"])
    torch.testing.assert_close(both, single, rtol=1e-5, atol=0)
    # Elastic: 10 steps on dp2, then the rest on one rank with the same global batch.
    elastic = tmp_path / "elastic"
    run_distributed(_train, 2, elastic, "e1.pt", {**dp2, "trainer__total_steps": 10}, tmp_dir=tmp_path)
    run_distributed(_train, 1, elastic, "e2.pt", dp2, 1, tmp_dir=tmp_path)
    resumed = torch.tensor(torch.load(tmp_path / "e2.pt")["losses"])
    torch.testing.assert_close(resumed, single, rtol=1e-5, atol=0)


def _lr_run(env: RankEnv, run_dir: Path, out: str, optimizer: str) -> None:
    config = parse_config(
        {
            **_config(run_dir, trainer__total_steps=6, checkpointing__period=None),
            "optimizer": {"provider": optimizer, "options": {"lr": 1e-2, "weight_decay": 0.01}},
            "lr_scheduler": {
                "provider": "piecewise",
                "options": {
                    "initial_multiplier": 0.0,
                    "phases": [
                        {"kind": "steps", "steps": 2, "target": 1.0, "curve": {"type": "linear"}},
                        {"kind": "rest", "target": 0.0, "curve": {"type": "linear"}},
                    ],
                },
            },
        }
    )
    points: list[Any] = []
    reporter = LocalRunReporter(config.checkpoint_dir, 1, points.append)
    runtime = RankRuntime(rank=0, world_size=1, local_rank=0, run_dir=run_dir)
    result = run_rank(config, runtime, reporter)
    lrs = [p.values["lr"] for p in points if p.kind == "train"]
    torch.save({"losses": list(result.losses), "lrs": lrs}, env.tmp_dir / out)


def test_piecewise_schedule_and_stochastic_adamw_providers(tmp_path: Path) -> None:
    run_distributed(_lr_run, 1, tmp_path / "a", "adamw.pt", "adamw", tmp_dir=tmp_path)
    run_distributed(_lr_run, 1, tmp_path / "s", "sr.pt", "stochastic_adamw", tmp_dir=tmp_path)
    adamw, sr = torch.load(tmp_path / "adamw.pt"), torch.load(tmp_path / "sr.pt")
    # The LR each step ran with (read before its scheduler update): warmup 0 -> 1 over 2 steps, then linear
    # to 0 at step 6 (the rate after the last step, never used).
    expected = [1e-2 * m for m in (0.0, 0.5, 1.0, 0.75, 0.5, 0.25)]
    torch.testing.assert_close(torch.tensor(adamw["lrs"]), torch.tensor(expected), rtol=1e-9, atol=1e-12)
    assert sr["lrs"] == adamw["lrs"]
    # fp32 parameters: the stochastic optimizer takes the exact AdamW step.
    torch.testing.assert_close(torch.tensor(sr["losses"]), torch.tensor(adamw["losses"]), rtol=1e-5, atol=0)


def _metrics_run(env: RankEnv, run_dir: Path, dp: int) -> None:
    raw = _config(run_dir, trainer__total_steps=6, checkpointing__period=None, logging__period=3)
    raw["mesh"] = {"data_parallel_replicate": dp}
    raw["task"] = {"provider": "tests.engine_fixtures:TokenCETask", "options": {"track_accuracy": True}}
    config = parse_config(raw)
    points: list[Any] = []
    reporter = LocalRunReporter(config.checkpoint_dir, 1, points.append)
    runtime = RankRuntime(rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=run_dir)
    run_rank(config, runtime, reporter)
    task_points = [(p.step, p.values) for p in points if any(k.startswith("task/") for k in p.values)]
    torch.save(task_points, env.tmp_dir / f"metrics-dp{dp}-rank{env.rank}.pt")


def test_task_metrics_are_synced_over_data_ranks(tmp_path: Path) -> None:
    run_distributed(_metrics_run, 1, tmp_path / "m1", 1, tmp_dir=tmp_path)
    run_distributed(_metrics_run, 2, tmp_path / "m2", 2, tmp_dir=tmp_path)
    single = torch.load(tmp_path / "metrics-dp1-rank0.pt")
    assert [step for step, _ in single] == [3, 6]
    both = torch.load(tmp_path / "metrics-dp2-rank0.pt")
    assert torch.load(tmp_path / "metrics-dp2-rank1.pt") == []  # one writer per distinct metric
    for (s1, v1), (s2, v2) in zip(single, both, strict=True):
        assert s1 == s2
        assert 0.0 <= v1["task/accuracy"] <= 1.0
        assert abs(v1["task/accuracy"] - v2["task/accuracy"]) < 1e-6, (v1, v2)


def test_checkpoint_of_an_incompatible_model_names_the_key(tmp_path: Path) -> None:
    run_distributed(_train, 1, tmp_path / "run", "w16.pt", {"trainer__total_steps": 5}, tmp_dir=tmp_path)
    with pytest.raises(
        Exception,
        # The run identity refuses it before any tensor is read (tests/test_checkpoint_trust.py covers the
        # DCP size-mismatch message for a commit without an identity).
        match=r"step-00000005 belongs to a different run(.|\n)*model\.options\.width: \"<unset>\" -> 8",
    ):
        run_distributed(
            _train,
            1,
            tmp_path / "run",
            "w8.pt",
            {"trainer__total_steps": 10, "model__options": {"width": 8}},
            tmp_dir=tmp_path,
            timeout=60,
        )


class _ScriptedReporter(LocalRunReporter):
    """Pauses at step 2, then delivers an lr update together with the resume in one poll."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, 1, self._record)
        self.lrs: list[float] = []
        self.polls = 0

    def _record(self, point: Any) -> None:
        if point.kind == "train":
            self.lrs.append(point.values["lr"])

    def commands(self, step: int) -> list[Any]:
        from d9d.engine.runtime import Command, CommandKind

        self.polls += 1
        if step == 2 and self.polls < 10:
            if self.polls == 3:
                return [Command(CommandKind.PAUSE)]
            if self.polls == 5:
                return [Command(CommandKind.UPDATE, {"lr": 1e-3}), Command(CommandKind.RESUME)]
        return []


def _paused_update(env: RankEnv, run_dir: Path) -> None:
    config = parse_config(_config(run_dir, trainer__total_steps=4, checkpointing__period=None))
    reporter = _ScriptedReporter(config.checkpoint_dir)
    runtime = RankRuntime(rank=0, world_size=1, local_rank=0, run_dir=run_dir)
    run_rank(config, runtime, reporter)
    assert reporter.lrs == [1e-2, 1e-2, 1e-3, 1e-3], reporter.lrs


def test_update_delivered_with_resume_is_applied(tmp_path: Path) -> None:
    run_distributed(_paused_update, 1, tmp_path / "run", tmp_dir=tmp_path, timeout=120)


def _train_recording_norms(
    env: RankEnv, run_dir: Path, out: str, fused: bool, max_norm: float | None, mesh: dict[str, int]
) -> None:
    overrides: dict[str, Any] = {
        "trainer__total_steps": 6,
        "checkpointing__period": None,
        "checkpointing__save_at_end": True,
        "optimizer__options": {"lr": 1e-2, "weight_decay": 0.01, "fused": fused},
        "gradient_clipping__max_norm": max_norm,
    }
    overrides.update({f"mesh__{k}": v for k, v in mesh.items()})
    config = parse_config(_config(run_dir, **overrides))
    points: list[Any] = []
    reporter = LocalRunReporter(config.checkpoint_dir, 1, points.append)
    runtime = RankRuntime(rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=run_dir)
    result = run_rank(config, runtime, reporter)
    norms = [p.values["grad_norm"] for p in points if p.kind == "train"]
    if env.rank == 0:
        torch.save({"losses": list(result.losses), "norms": norms}, env.tmp_dir / out)


@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_fused_adam_divides_summed_gradients_like_a_separate_pass(
    tmp_path: Path, max_norm: float | None
) -> None:
    """Fused AdamW gets the gradients as sums and the loss weight (with clipping's factor) as its divisor;
    foreach AdamW gets them divided and clipped in place first. Same losses, gradient norms and parameters
    (float32 on CPU), on one rank and on two data-parallel ranks (replicated DTensor parameters; the
    synchronizer then leaves the division out too)."""
    layouts: dict[str, tuple[bool, dict[str, int]]] = {
        "foreach": (False, {}),
        "fused": (True, {}),
        "fused-dp2": (True, {"data_parallel_replicate": 2}),
    }
    runs = {}
    for name, (fused, mesh) in layouts.items():
        ranks = max(1, math.prod(mesh.values()))
        run_distributed(
            _train_recording_norms,
            ranks,
            tmp_path / name,
            f"{name}.pt",
            fused,
            max_norm,
            mesh,
            tmp_dir=tmp_path,
        )
        runs[name] = torch.load(tmp_path / f"{name}.pt")
    reference = runs["foreach"]
    assert len(reference["norms"]) == 6 and reference["losses"][-1] < reference["losses"][0]
    if max_norm is not None:
        assert max(reference["norms"]) > 2 * max_norm  # clipping binds
    for name in ("fused", "fused-dp2"):
        torch.testing.assert_close(
            torch.tensor(runs[name]["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0
        )
        torch.testing.assert_close(
            torch.tensor(runs[name]["norms"]), torch.tensor(reference["norms"]), rtol=1e-5, atol=0
        )
        ref_params, params = _final_params(tmp_path / "foreach"), _final_params(tmp_path / name)
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=1e-5, atol=1e-6)


def _freeze_counts(env: RankEnv, run_dir: Path, freeze: bool) -> None:
    import gc

    from d9d.core.context import DistributedContext
    from d9d.engine.events import EventBus, StepStarted
    from d9d.engine.trainer import Trainer

    overrides = {"trainer__total_steps": 4, "checkpointing__period": None, "gc__freeze": freeze}
    config = parse_config(_config(run_dir, mesh__data_parallel_replicate=2, **overrides))
    events = EventBus()
    counts: list[int] = []
    events.subscribe(StepStarted, lambda e: counts.append(gc.get_freeze_count()))
    reporter = LocalRunReporter(config.checkpoint_dir, 1)
    trainer = Trainer(config, DistributedContext.create(config.mesh), reporter, events)
    trainer.setup()
    result = trainer.train()
    counts.append(gc.get_freeze_count())
    out = env.tmp_dir / f"freeze-{freeze}-{env.rank}.pt"
    torch.save({"counts": counts, "losses": list(result.losses)}, out)


def test_live_objects_leave_the_collectors_scans_after_the_first_step(tmp_path: Path) -> None:
    """`gc.freeze` (default on): nothing is frozen before the first step, the live heap is from the second
    step on (a full collection then skips it), and it is released when training ends; off, nothing is
    frozen. Losses are the same either way."""
    for freeze in (True, False):
        run_distributed(_freeze_counts, 2, tmp_path / f"run-{freeze}", freeze, tmp_dir=tmp_path, timeout=180)
    for rank in range(2):
        on, off = (torch.load(tmp_path / f"freeze-{f}-{rank}.pt") for f in (True, False))
        assert on["counts"][0] == 0 and all(n > 1000 for n in on["counts"][1:-1]), on["counts"]
        assert on["counts"][-1] == 0  # unfrozen at the end of training
        assert off["counts"] == [0] * 5
        assert on["losses"] == off["losses"]
