"""Pipelined (and context-parallel) inference: the perplexity of an HF checkpoint over pp = 2 stages, with
several microbatches in flight and a short last step, equals transformers' (which equals pp = 1:
tests/test_engine_inference.py); what cannot run is rejected when the config is validated."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from d9d.core import DeviceMeshParameters, DistributedContext
from d9d.engine.inference import InferenceConfig, run_inference
from tests.engine_fixtures import make_hf_qwen3, sample_tokens
from tests.harness import RankEnv, run_distributed

NUM_SAMPLES = 10


class FiniteSteps:
    """`num_samples` sequences split over dp ranks, `gradient_accumulation` microbatches per step until
    they run out (the last step gets fewer)."""

    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")
        num_samples: int = NUM_SAMPLES

    def __init__(self, config: Config) -> None:
        self.config = config
        self.position = 0

    def setup(self, setup: Any) -> None:
        self.s = setup
        self.samples = list(range(setup.dp_rank, self.config.num_samples, setup.dp_size))

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        out = []
        for _ in range(self.s.gradient_accumulation):
            ids = self.samples[self.position : self.position + self.s.microbatch_size]
            if not ids:
                break
            self.position += len(ids)
            batch = torch.stack([sample_tokens(i) for i in ids])
            out.append({"input_ids": batch[:, :-1], "labels": batch[:, 1:]})
        return out

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def _raw(run_dir: Path, checkpoint: Path, mesh: dict[str, int], **extra: Any) -> dict[str, Any]:
    return {
        "run": {"name": "ppl", "dir": str(run_dir)},
        "mesh": mesh,
        "microbatch_size": 2,
        "model": {"provider": "qwen3", "options": {"source_checkpoint": str(checkpoint)}},
        "data": {"provider": "tests.test_engine_inference_pp:FiniteSteps"},
        **extra,
    }


def _perplexity(
    env: RankEnv, checkpoint: Path, cases: list[tuple[str, dict[str, int], dict[str, Any]]]
) -> None:
    for name, mesh, extra in cases:
        config = InferenceConfig.model_validate(_raw(env.tmp_dir / name, checkpoint, mesh, **extra))
        ctx = DistributedContext.create(DeviceMeshParameters(**mesh), backend="gloo")
        result = run_inference(config, ctx)
        if env.rank == 0:
            torch.save(result, env.tmp_dir / f"{name}.pt")


@pytest.mark.distributed
def test_pipelined_perplexity_matches_transformers(tmp_path: Path) -> None:
    checkpoint = tmp_path / "hf"
    model = make_hf_qwen3(checkpoint, num_layers=6)
    tokens = torch.stack([sample_tokens(i) for i in range(NUM_SAMPLES)])
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    two = [
        ("pp2", {"pipeline_parallel": 2}, {}),  # 2 microbatches per step: 2, 2, 1
        (
            "pp2-looped",
            {"pipeline_parallel": 2},
            {"pipelining": {"kind": "inference", "stages_per_rank": 2}, "microbatches_per_step": 3},
        ),
        ("cp2", {"context_parallel_shard": 2}, {}),
        ("tp2", {"tensor_parallel": 2}, {}),  # tp ranks hold the same outputs: counted once
    ]
    four = [("pp2-cp2", {"pipeline_parallel": 2, "context_parallel_shard": 2}, {})]
    run_distributed(_perplexity, 2, checkpoint, two, tmp_dir=tmp_path, timeout=200)
    run_distributed(_perplexity, 4, checkpoint, four, tmp_dir=tmp_path, timeout=200)
    for name, _, _ in [*two, *four]:
        result = torch.load(tmp_path / f"{name}.pt")
        assert result["tokens"] == tokens[:, 1:].numel(), (name, result)  # every token counted once
        assert math.isclose(result["perplexity"], math.exp(nll.item()), rel_tol=1e-5), (name, result)


def test_unsupported_inference_is_rejected_by_the_config(tmp_path: Path) -> None:
    checkpoint = tmp_path / "hf"
    make_hf_qwen3(checkpoint)
    raw = _raw(tmp_path / "run", checkpoint, {"pipeline_parallel": 2})
    raw["model"]["options"]["architecture"] = {"tie_word_embeddings": True}
    with pytest.raises(ValueError, match=r"mesh.pipeline_parallel = 2.*tie_word_embeddings"):
        InferenceConfig.model_validate(raw)
    raw = _raw(tmp_path / "run", checkpoint, {"context_parallel_shard": 2})
    raw["model"]["options"]["architecture"] = {"attention_backend": "flash_attn"}
    with pytest.raises(ValueError, match=r"context_parallel.*attention_backend 'flash_attn'"):
        InferenceConfig.model_validate(raw)
    raw = _raw(tmp_path / "run", checkpoint, {"pipeline_parallel": 2}, pipelining={"kind": "1f1b"})
    with pytest.raises(ValueError, match=r"pipelining"):  # a training schedule
        InferenceConfig.model_validate(raw)
    raw = _raw(
        tmp_path / "run",
        checkpoint,
        {"pipeline_parallel": 2},
        pipelining={"kind": "inference", "stages_per_rank": 2},
    )
    with pytest.raises(ValueError, match=r"stages_per_rank.*2 layers.*cannot be split over 4 stages"):
        InferenceConfig.model_validate(raw)
