"""The engine with pipeline parallelism: tiny Qwen3 on pp2 under several schedules equals one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import ConfigError, parse_config
from d9d.engine.launch import run_rank
from d9d.engine.runtime import RankRuntime
from tests.engine_fixtures import make_hf_qwen3
from tests.harness import RankEnv, run_distributed


def _config(run_dir: Path, pp: int, schedule: dict[str, Any] | None) -> dict[str, Any]:
    # Random init is seeded per pipeline stage (d9d.determinism), so layouts are compared from one checkpoint.
    return {
        "run": {"name": "pp", "dir": str(run_dir)},
        "mesh": {"pipeline_parallel": pp},
        "pipelining": schedule,
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": 4},
        "logging": {"progress_bar": "off"},
        "checkpointing": {"save_at_end": False},
        "model": {"provider": "qwen3", "options": {"source_checkpoint": str(run_dir.parent / "hf")}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
    }


def _run(env: RankEnv, pp: int, schedules: list[dict[str, Any] | None]) -> None:
    for i, schedule in enumerate(schedules):
        config = parse_config(_config(env.tmp_dir / f"run{pp}-{i}", pp, schedule))
        reporter = LocalRunReporter(config.checkpoint_dir, 1)
        runtime = RankRuntime(
            rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=config.run_dir
        )
        result = run_rank(config, runtime, reporter)
        if env.rank == 0:
            torch.save(list(result.losses), env.tmp_dir / f"pp{pp}-{i}.pt")


SCHEDULES: list[dict[str, Any] | None] = [{"kind": "1f1b"}, {"kind": "zbv"}, {"kind": "dualpipev"}]


@pytest.mark.distributed
def test_pipelined_training_equals_one_process(tmp_path: Path) -> None:
    make_hf_qwen3(tmp_path / "hf", num_layers=6)
    run_distributed(_run, 1, 1, [None], tmp_dir=tmp_path, timeout=300)
    run_distributed(_run, 2, 2, SCHEDULES, tmp_dir=tmp_path, timeout=400)
    reference = torch.tensor(torch.load(tmp_path / "pp1-0.pt"))
    assert len(reference) == 4
    for i, schedule in enumerate(SCHEDULES):
        losses = torch.tensor(torch.load(tmp_path / f"pp2-{i}.pt"))
        torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6, msg=f"{schedule}")


def test_schedule_errors_at_config_time(tmp_path: Path) -> None:
    make_hf_qwen3(tmp_path / "hf", num_layers=6)
    raw = _config(tmp_path / "run", 2, {"kind": "dualpipev"})  # source_checkpoint: tmp_path / "hf"
    raw["batching"] = {"global_batch_size": 4, "microbatch_size": 2}  # 2 microbatches < 2·pp - 1
    with pytest.raises(ConfigError, match=r"pipelining \(dualpipev, 2 microbatches per step\).*at least"):
        parse_config(raw)
