"""Sequence parallelism with pipeline parallelism: tiny Qwen3 trained by the engine on pp2 × tp2 with
sequence_parallel under the ZBV schedule equals one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import parse_config
from d9d.engine.launch import run_rank
from d9d.engine.runtime import RankRuntime
from tests.engine_fixtures import make_hf_qwen3
from tests.harness import RankEnv, run_distributed


def _config(
    run_dir: Path,
    mesh: dict[str, int],
    schedule: dict[str, Any] | None,
    compile_: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "compile": compile_ or {},
        "run": {"name": "sp-pp", "dir": str(run_dir)},
        "mesh": mesh,
        "pipelining": schedule,
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": 2},
        "logging": {"progress_bar": "off"},
        "checkpointing": {"save_at_end": False},
        "model": {
            "provider": "qwen3",
            "options": {
                "source_checkpoint": str(run_dir.parent / "hf"),
                "parallel": {"sequence_parallel": mesh.get("tensor_parallel", 1) > 1},
            },
        },
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
    }


def _run(
    env: RankEnv,
    mesh: dict[str, int],
    schedules: list[dict[str, Any] | None],
    compile_: dict[str, Any] | None = None,
) -> None:
    for i, schedule in enumerate(schedules):
        config = parse_config(_config(env.tmp_dir / f"run{env.world_size}-{i}", mesh, schedule, compile_))
        runtime = RankRuntime(
            rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=config.run_dir
        )
        result = run_rank(config, runtime, LocalRunReporter(config.checkpoint_dir, 1))
        if env.rank == 0:
            torch.save(list(result.losses), env.tmp_dir / f"losses{env.world_size}-{i}.pt")


# ZBV: two stages per rank in a V, so both ranks hold a non-last stage (whose boundary gathers the
# sequence) and the stage-1 → stage-2 boundary is a hand-over inside rank 1
SCHEDULES: list[dict[str, Any] | None] = [{"kind": "zbv"}]


@pytest.mark.distributed
def test_sequence_parallel_with_pipeline_equals_one_process(tmp_path: Path) -> None:
    make_hf_qwen3(tmp_path / "hf", num_layers=6)
    run_distributed(_run, 1, {}, [None], tmp_dir=tmp_path, timeout=200)
    mesh = {"pipeline_parallel": 2, "tensor_parallel": 2}
    run_distributed(_run, 4, mesh, SCHEDULES, tmp_dir=tmp_path, timeout=300)
    reference = torch.tensor(torch.load(tmp_path / "losses1-0.pt"))
    assert len(reference) == 2
    for i, schedule in enumerate(SCHEDULES):
        losses = torch.tensor(torch.load(tmp_path / f"losses4-{i}.pt"))
        torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6, msg=f"{schedule}")


@pytest.mark.distributed
def test_compiled_tensor_parallel_blocks_with_deferred_weight_grads_equal_one_process(tmp_path: Path) -> None:
    """pp 2 × tp 2 (sequence parallel) under ZBV with compiled blocks whose projections run eagerly for the
    weight pass (`defer_weight_grads`): the row-split projections' sums, the region entries' gradient sums
    and the deferred weight gradients compose."""
    make_hf_qwen3(tmp_path / "hf", num_layers=6)
    run_distributed(_run, 1, {}, [None], tmp_dir=tmp_path, timeout=200)
    mesh = {"pipeline_parallel": 2, "tensor_parallel": 2}
    compile_ = {"enabled": True, "backend": "aot_eager", "defer_weight_grads": True}
    run_distributed(_run, 4, mesh, SCHEDULES, compile_, tmp_dir=tmp_path, timeout=400)
    reference = torch.tensor(torch.load(tmp_path / "losses1-0.pt"))
    losses = torch.tensor(torch.load(tmp_path / "losses4-0.pt"))
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6)
