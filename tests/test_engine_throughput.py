"""The logged throughput and MFU count the positions the model processed (padding excluded), not the tokens
the loss is taken over: an SFT-like batch (prompts masked out of the labels, rows padded) under one process
and every layout that splits or copies the batch (dp, pp, cp, tp)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from d9d.data.collate import CausalLMCollator
from tests.harness import RankEnv, run_distributed

VOCAB = 32
GLOBAL_BATCH = 4
MICROBATCH = 2
STEPS = 2


def _sample(index: int) -> tuple[torch.Tensor, int]:
    """Global sample `index`: its token ids (3 to 12 of them) and its prompt length (labels masked)."""
    g = torch.Generator().manual_seed(500 + index)
    length = int(torch.randint(3, 13, (1,), generator=g))
    prompt = int(torch.randint(1, length - 1, (1,), generator=g))
    return torch.randint(0, VOCAB, (length,), generator=g), prompt


class SFTData:
    """Step s takes global samples [s·G, (s+1)·G), dp rank d its contiguous share; each microbatch padded to
    its longest row (attention mask 0 on padding), labels -100 on each prompt."""

    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, config: Config) -> None:
        self.step = 0
        self.collate = CausalLMCollator(pad_id=0, pad_to_multiple_of=4)  # context parallelism cuts 4 chunks

    def setup(self, setup: Any) -> None:
        self.s = setup

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        s = self.s
        per_rank = s.global_batch_size // s.dp_size
        base = self.step * s.global_batch_size + s.dp_rank * per_rank
        self.step += 1
        out = []
        for first in range(base, base + per_rank, s.microbatch_size):
            samples = [_sample(i) for i in range(first, first + s.microbatch_size)]
            batch = self.collate([{"input_ids": ids} for ids, _ in samples])
            del batch["document_ids"]  # not a model input (context parallelism splits only those)
            for row, (_, prompt) in enumerate(samples):
                batch["labels"][row, :prompt] = -100
            out.append(batch)
        return out

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def _expected(step: int) -> tuple[int, int]:
    """(positions the model processes, loss tokens) of global step `step` (1-based), from the samples."""
    samples = [_sample(i) for i in range((step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH)]
    # the loss: each position after the prompt predicts the next token, but the last token predicts none
    return sum(len(ids) for ids, _ in samples), sum(len(ids) - 1 - prompt for ids, prompt in samples)


PEAK = 1e9  # a made-up device peak: CPU ranks have none, so the test gives the budget one


def _run(env: RankEnv, runs: list[tuple[str, dict[str, int], str | None]]) -> None:
    from d9d.core import DistributedContext
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.config import parse_config
    from d9d.engine.reporting import FlopsBudget
    from d9d.engine.trainer import Trainer

    for name, mesh, schedule in runs:
        points: list[Any] = []
        config = parse_config(
            {
                "run": {"name": name, "dir": str(env.tmp_dir / name)},
                "mesh": mesh,
                "pipelining": None if schedule is None else {"kind": schedule},
                "batching": {"global_batch_size": GLOBAL_BATCH, "microbatch_size": MICROBATCH},
                "trainer": {"total_steps": STEPS},
                "logging": {"progress_bar": "off", "period": 1},
                "checkpointing": {"save_at_end": False},
                "model": {"provider": "qwen3", "options": {"source_checkpoint": str(env.tmp_dir / "hf")}},
                "data": {"provider": "tests.test_engine_throughput:SFTData"},
                "optimizer": {"provider": "sgd", "options": {"lr": 0.1}},
            }
        )
        trainer = Trainer(
            config,
            DistributedContext.create(config.mesh),
            LocalRunReporter(config.checkpoint_dir, 1, points.append),
        )
        trainer.setup()
        model = trainer.parts.model
        assert trainer.parts.reports.flops is None  # CPU: no peak known
        trainer.parts.reports.flops = FlopsBudget(model.flops_per_token, GLOBAL_BATCH, PEAK)  # type: ignore[attr-defined]
        result = trainer.train()
        if env.rank == 0:
            train = [p.values for p in points if p.kind == "train" and "loss" in p.values]
            flops = {n: model.flops_per_token(n) for n in range(1, 13)}  # type: ignore[attr-defined]
            torch.save((train, result.tokens_per_s, flops), env.tmp_dir / f"{name}.pt")


def test_processed_positions_count_the_attention_mask_else_every_input_position() -> None:
    from d9d.engine.step import processed_positions

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    ids = torch.zeros(2, 4, dtype=torch.long)
    segments = torch.tensor([[0, 0, 1, -1], [0, 1, 2, 3]])
    batches = [
        {"input_ids": ids, "attention_mask": mask, "segment_ids": segments},
        {"input_ids": ids, "segment_ids": segments},
        {"input_ids": ids},
    ]
    assert processed_positions(batches) == 5 + 7 + 8
    # a batch that marks neither padding nor inputs: unknown, not a guess (no tokens_per_s, no MFU)
    assert math.isnan(processed_positions([{"input_ids": ids}, {"pixels": ids}]))


@pytest.mark.distributed
def test_tokens_per_s_and_mfu_count_processed_positions_not_loss_tokens(tmp_path: Path) -> None:
    from tests.engine_fixtures import make_hf_qwen3

    make_hf_qwen3(tmp_path / "hf", num_layers=2)
    run_distributed(_run, 1, [("one", {}, None)], tmp_dir=tmp_path, timeout=300)
    layouts: list[tuple[str, dict[str, int], str | None]] = [
        ("dp2", {"data_parallel_replicate": 2}, None),
        ("pp2", {"pipeline_parallel": 2}, "1f1b"),
        ("cp2", {"context_parallel_shard": 2}, None),
        ("tp2", {"tensor_parallel": 2}, None),
    ]
    run_distributed(_run, 2, layouts, tmp_dir=tmp_path, timeout=300)
    for name in ["one"] + [n for n, _, _ in layouts]:
        train, final_tokens_per_s, flops = torch.load(tmp_path / f"{name}.pt")
        assert len(train) == STEPS, name
        for step, values in enumerate(train, 1):
            positions, loss_tokens = _expected(step)
            assert positions > loss_tokens  # masked prompts: the two counts differ
            time_s = values["step_time_s"]
            assert values["tokens_per_s"] == pytest.approx(positions / time_s, rel=1e-9), (name, step)
            assert values["loss_tokens_per_s"] == pytest.approx(loss_tokens / time_s, rel=1e-9), (name, step)
            want_mfu = positions * flops[round(positions / GLOBAL_BATCH)] / time_s / PEAK
            assert values["mfu"] == pytest.approx(want_mfu, rel=1e-9), (name, step)
        assert final_tokens_per_s == train[-1]["tokens_per_s"], name  # the run's result (run summary)
