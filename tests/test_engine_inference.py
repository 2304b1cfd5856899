"""Inference: perplexity of an HF checkpoint through d9d equals transformers' on the same tokens."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from d9d.core import DeviceMeshParameters, DistributedContext
from d9d.engine.inference import InferenceConfig, run_inference
from tests.engine_fixtures import make_hf_qwen3, sample_tokens
from tests.harness import RankEnv, run_distributed

pytestmark = pytest.mark.distributed


def _perplexity(env: RankEnv, checkpoint: Path, dp: int) -> None:
    config = InferenceConfig.model_validate(
        {
            "run": {"name": "ppl", "dir": str(env.tmp_dir / f"ppl{dp}")},
            "mesh": {"data_parallel_replicate": dp},
            "microbatch_size": 3,
            "model": {"provider": "qwen3", "options": {"source_checkpoint": str(checkpoint)}},
            "data": {"provider": "tests.engine_fixtures:FiniteTokens", "options": {"num_samples": 10}},
        }
    )
    ctx = DistributedContext.create(DeviceMeshParameters(data_parallel_replicate=dp), backend="gloo")
    result = run_inference(config, ctx)
    if env.rank == 0:
        torch.save(result, env.tmp_dir / f"ppl{dp}.pt")


def test_perplexity_matches_transformers(tmp_path: Path) -> None:
    checkpoint = tmp_path / "hf"
    model = make_hf_qwen3(checkpoint)
    tokens = torch.stack([sample_tokens(i) for i in range(10)])
    # transformers' logits scored on every next token: the targets d9d's data gives as labels.
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    for dp in (1, 2):
        run_distributed(_perplexity, dp, checkpoint, dp, tmp_dir=tmp_path, timeout=180)
        result = torch.load(tmp_path / f"ppl{dp}.pt")
        assert result["tokens"] == tokens[:, 1:].numel()
        assert math.isclose(result["perplexity"], math.exp(nll.item()), rel_tol=1e-5), (dp, result)
