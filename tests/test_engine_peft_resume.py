"""`checkpointing.trainable_only`: LoRA runs checkpoint only adapters (+ optimizer state) and still resume
bitwise, the frozen base being re-loaded from its source checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.checkpoint import LocalRunReporter, read_latest
from d9d.engine.config import parse_config
from d9d.engine.launch import run_rank
from d9d.engine.runtime import RankRuntime
from tests.engine_fixtures import make_hf_qwen3
from tests.harness import RankEnv, run_distributed

pytestmark = pytest.mark.distributed


def _train(env: RankEnv, run_dir: Path, out: str, steps: int) -> None:
    raw: dict[str, Any] = {
        "run": {"name": "lora", "dir": str(run_dir)},
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": steps},
        "logging": {"progress_bar": "off"},
        "checkpointing": {"trainable_only": True, "period": 3},
        "model": {
            "provider": "peft",
            "options": {
                "base": {"provider": "qwen3", "options": {"source_checkpoint": str(env.tmp_dir / "hf")}},
                "method": {
                    "kind": "lora",
                    "target_modules": r".*\.(q_proj|v_proj)$",
                    "rank": 4,
                    "dropout": 0.1,
                },
            },
        },
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-2}},
    }
    config = parse_config(raw)
    reporter = LocalRunReporter(config.checkpoint_dir, 2)
    runtime = RankRuntime(rank=0, world_size=1, local_rank=0, run_dir=run_dir)
    result = run_rank(config, runtime, reporter)
    torch.save(list(result.losses), env.tmp_dir / out)


@pytest.mark.parametrize(
    "backend",
    # On CUDA the base is built on the meta device, materialized on the GPU and loaded from the source
    # checkpoint at every start (the resumed run's frozen weights never come from the d9d checkpoint).
    ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)],
)
def test_trainable_only_checkpoints_resume_bitwise(tmp_path: Path, backend: str) -> None:
    make_hf_qwen3(tmp_path / "hf")
    for run, out, steps in (("straight", "a.pt", 6), ("split", "b1.pt", 3), ("split", "b2.pt", 6)):
        run_distributed(_train, 1, tmp_path / run, out, steps, tmp_dir=tmp_path, timeout=240, backend=backend)
    straight = torch.load(tmp_path / "a.pt")
    assert len(straight) == 6
    assert torch.load(tmp_path / "b2.pt") == straight  # dropout included: RNG and data resume too
    # The checkpoint holds adapter weights, not the frozen base.
    from torch.distributed.checkpoint import FileSystemReader

    latest = read_latest(tmp_path / "split" / "checkpoints")
    assert latest is not None
    keys = FileSystemReader(str(latest)).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("app.model.")]
    assert model_keys, keys
    assert all("lora_" in k for k in model_keys), model_keys
