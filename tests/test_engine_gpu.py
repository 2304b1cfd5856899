"""The engine on CUDA/NCCL: torchrun on 2 GPUs (expert parallel, then pipeline parallel) against gloo/CPU."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.engine_fixtures import jsonl_losses, subprocess_env, torchrun_command


def _hf_moe(path: Path) -> None:
    """GPU and CPU random init draw different streams, so both runs start from one checkpoint."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)


def _job(run_dir: Path, mesh: dict[str, int]) -> dict[str, Any]:
    return {
        "run": {"name": "gpu", "dir": str(run_dir)},
        "mesh": mesh,
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": 8},
        "logging": {"progress_bar": "off"},
        "checkpointing": {"period": 4},
        "model": {"provider": "qwen3_moe", "options": {"source_checkpoint": str(run_dir.parent / "hf")}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
    }


def _torchrun(tmp: Path, name: str, mesh: dict[str, int], cuda: bool) -> list[float]:
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump(_job(tmp / name, mesh)))
    env = subprocess_env(CUDA_VISIBLE_DEVICES="") if not cuda else subprocess_env()  # gloo/CPU reference
    cmd = torchrun_command(job)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return jsonl_losses(tmp / name)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mesh",
    [{"data_parallel_replicate": 2, "expert_parallel": 2}, {"pipeline_parallel": 2}],
    ids=["dp2xep2", "pp2"],
)
def test_engine_on_two_gpus_matches_gloo(tmp_path: Path, mesh: dict[str, int]) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _hf_moe(tmp_path / "hf")
    gpu = _torchrun(tmp_path, "nccl", mesh, cuda=True)
    cpu = _torchrun(tmp_path, "gloo", mesh, cuda=False)
    assert len(gpu) == len(cpu) == 8
    assert gpu[-1] < gpu[0]
    # TF32 / kernel differences on the GPU: the trajectories agree closely, not bitwise.
    for a, b in zip(gpu, cpu, strict=True):
        assert abs(a - b) <= 2e-3 * abs(b), (gpu, cpu)
