"""Inference on uneven data under layouts whose forward runs collectives (FSDP, expert parallelism, FSDP ×
pipeline): a data-parallel rank that runs out of data first runs placeholder forwards in step with the
others instead of leaving them stuck in an all-gather, and nothing of the placeholders reaches the result:
the perplexity and token count equal transformers' over exactly the given samples, which a one-process
forward computes independently of d9d."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.core import DeviceMeshParameters, DistributedContext
from d9d.engine.inference import STATE_FILE, InferenceConfig, run_inference
from tests.engine_fixtures import make_hf_qwen3_moe, sample_tokens
from tests.harness import RankEnv, run_distributed

pytestmark = pytest.mark.distributed

# name, mesh, samples, extra config. With 2 samples per microbatch and dp 2, 9 samples give rank 0
# microbatches of 2, 2, 1 and rank 1 of 2, 2: rank 1 runs one placeholder forward.
Case = tuple[str, dict[str, int], int, dict[str, Any]]
TWO: list[Case] = [
    ("fsdp2", {"data_parallel_shard": 2}, 9, {"save_period": 1}),  # progress saved in step, every step
    ("ep2", {"data_parallel_replicate": 2, "expert_parallel": 2}, 9, {}),
    ("fsdp2-one-sample", {"data_parallel_shard": 2}, 1, {}),  # rank 1 never has data: borrows rank 0's
]
# pp 2 × fsdp 2, two microbatches per step: replica 0 runs steps of 2 and 1 microbatches, replica 1 only the
# first, so it runs a placeholder step through the pipeline.
FOUR: list[Case] = [("pp2-fsdp2", {"pipeline_parallel": 2, "data_parallel_shard": 2}, 9, {})]


def _perplexity(env: RankEnv, checkpoint: Path, cases: list[Case]) -> None:
    for name, mesh, samples, extra in cases:
        config = InferenceConfig.model_validate(
            {
                "run": {"name": "ppl", "dir": str(env.tmp_dir / name)},
                "mesh": mesh,
                "microbatch_size": 2,
                "model": {"provider": "qwen3_moe", "options": {"source_checkpoint": str(checkpoint)}},
                "data": {
                    "provider": "tests.test_engine_inference_pp:FiniteSteps",
                    "options": {"num_samples": samples},
                },
                **extra,
            }
        )
        ctx = DistributedContext.create(DeviceMeshParameters(**mesh), backend="gloo")
        result = run_inference(config, ctx)
        if env.rank == 0:
            torch.save(result, env.tmp_dir / f"{name}.pt")


def _reference(model: torch.nn.Module, samples: int) -> tuple[float, int]:
    tokens = torch.stack([sample_tokens(i) for i in range(samples)])
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), tokens[:, 1:].flatten())
    return math.exp(nll.item()), tokens[:, 1:].numel()


def _check(tmp_path: Path, model: torch.nn.Module, cases: list[Case]) -> None:
    for name, _, samples, _ in cases:
        perplexity, tokens = _reference(model, samples)
        result = torch.load(tmp_path / f"{name}.pt")
        assert result["tokens"] == tokens, (name, result)  # no placeholder token counted
        assert math.isclose(result["perplexity"], perplexity, rel_tol=1e-5), (name, result, perplexity)
        assert not (tmp_path / name / STATE_FILE).exists()  # finished: no progress left behind


def test_uneven_inference_under_fsdp_and_expert_parallel_matches_transformers(tmp_path: Path) -> None:
    checkpoint = tmp_path / "hf"
    model = make_hf_qwen3_moe(checkpoint)
    # Before the fix rank 1 waited in the end-of-data all-reduce while rank 0 was in FSDP's all-gather:
    # the run hung until the collectives' timeout; the harness timeout turns that into a failure.
    run_distributed(_perplexity, 2, checkpoint, TWO, tmp_dir=tmp_path, timeout=180)
    _check(tmp_path, model, TWO)


def test_uneven_pipelined_inference_under_fsdp_matches_transformers(tmp_path: Path) -> None:
    checkpoint = tmp_path / "hf"
    model = make_hf_qwen3_moe(checkpoint)
    run_distributed(_perplexity, 4, checkpoint, FOUR, tmp_dir=tmp_path, timeout=240)
    _check(tmp_path, model, FOUR)
