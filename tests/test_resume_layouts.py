"""Resuming under another mesh layout continues the run it interrupted: a run saved at step 3 under one
layout and resumed to step 6 under another gives the losses, learning rates and expert biases of the same
job run 6 steps without a stop. The layouts change what each rank holds — stages per rank (1F1B's one →
ZBV's two, whose LR schedulers come from one saved state), sequence shards, tensor and expert shards — so
the checkpoint's reshard, the optimizer state and the data position are all on the path.

A tiny Qwen3-MoE with the expert bias and a learning-rate schedule, one sample per microbatch (so the
microbatch grouping, which the balancing loss depends on by design, is the same on both sides), on gloo and
on 2 GPUs over NCCL (the engine's CUDA defaults: compiled blocks, the checkpoint staged asynchronously from
pinned memory; float32 there, so the bound is about the resume rather than bf16 rounding)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import parse_config
from tests.harness import RankEnv, run_distributed
from tests.test_engine_builtin import ARCH
from tests.test_trust_resume import SCHEDULE

pytestmark = pytest.mark.distributed

STEPS, STOP = 6, 3
# the engine tests' tiny Qwen3-MoE with the byte tokenizer's vocabulary, six layers (ZBV: four stages, the
# first also holding the embedding) and no balancing loss (per microbatch by design)
ARCHITECTURE = {
    **ARCH,
    "vocab_size": 259,
    "num_layers": 6,
    "router_aux_loss_coef": 0.0,
    "expert_bias_update_rate": 0.01,
}


def _job(
    tmp: Path, name: str, mesh: dict[str, int], total: int, schedule: str | None, backend: str
) -> dict[str, Any]:
    options: dict[str, Any] = {"architecture": ARCHITECTURE}
    if backend == "nccl":  # CUDA's FlexAttention kernels take heads of 16 or more
        options = {"architecture": {**ARCHITECTURE, "head_dim": 16}, "dtype": "float32"}
    return {
        "run": {"name": name, "dir": str(tmp / name)},
        "mesh": mesh,
        "pipelining": None if schedule is None else {"kind": schedule},
        "batching": {"global_batch_size": 4, "microbatch_size": 1},
        "trainer": {"total_steps": total},
        "logging": {"progress_bar": "off"},
        "checkpointing": {"period": STOP, "save_at_end": False},
        "model": {"provider": "qwen3_moe", "options": options},
        "data": {
            "provider": "text",
            "options": {"dataset": {"paths": [str(tmp / "corpus.txt")], "max_length": 48}, "pack_length": 48},
        },
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-2, "eps": 0.1, "weight_decay": 0.01}},
        "lr_scheduler": SCHEDULE,
        "gradient_clipping": {"max_norm": 0.5},
    }


def _train(env: RankEnv, raw: dict[str, Any], out: str) -> None:
    from d9d.core import DistributedContext
    from d9d.engine.trainer import Trainer
    from d9d.modules.moe import TopKRouter

    config = parse_config(raw)
    points: list[Any] = []
    reporter = LocalRunReporter(config.checkpoint_dir, config.checkpointing.keep_last, points.append)
    trainer = Trainer(config, DistributedContext.create(config.mesh), reporter)
    trainer.setup()
    result = trainer.train()
    lrs = {p.step: p.values["lr"] for p in points if p.kind == "train" and "lr" in p.values}
    biases = {  # the layers' names carry their global index: pipeline ranks hold disjoint parts
        name: m.expert_bias.detach().cpu()  # on the host: the two runs may hold a layer on other GPUs
        for module in trainer.modules
        for name, m in module.named_modules()
        if isinstance(m, TopKRouter) and m.expert_bias is not None
    }
    gathered: list[Any] = [None] * env.world_size
    torch.distributed.all_gather_object(gathered, biases)
    if env.rank == 0:
        merged = {k: v for rank_biases in gathered for k, v in rank_biases.items()}
        torch.save({"losses": list(result.losses), "lrs": lrs, "biases": merged}, env.tmp_dir / out)


CASES = {
    # stages per rank 1 → 2: the ZBV stages' LR schedulers restored from the one saved state
    "fsdp2-to-pp2-zbv": (({"data_parallel_shard": 2}, None), ({"pipeline_parallel": 2}, "zbv")),
    "cp2-to-fsdp2xep2": (
        ({"context_parallel_shard": 2}, None),
        ({"data_parallel_shard": 2, "expert_parallel": 2}, None),
    ),
    "tp2-to-dp2": (({"tensor_parallel": 2}, None), ({"data_parallel_replicate": 2}, None)),
    # replicas keep plain parameters and optimizer state, which both ranks hold under the same keys
    "dp2-to-fsdp2": (({"data_parallel_replicate": 2}, None), ({"data_parallel_shard": 2}, None)),
}


@pytest.mark.parametrize(
    "backend", ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.gpus(2)])]
)
@pytest.mark.parametrize("case", list(CASES))
def test_a_resume_under_another_layout_continues_the_uninterrupted_run(
    tmp_path: Path, case: str, backend: str
) -> None:
    (tmp_path / "corpus.txt").write_text(
        "".join(f"document {i}: {'abcdefghijklm'[: 1 + i % 13] * (1 + i % 5)}\n" for i in range(200))
    )
    (mesh_a, schedule_a), (mesh_b, schedule_b) = CASES[case]
    timeout = 90.0 if backend == "gloo" else 300.0  # CUDA: NCCL set-up and the blocks' first compile
    for name, mesh, total, schedule, out in (
        ("straight", mesh_a, STEPS, schedule_a, "straight.pt"),
        ("split", mesh_a, STOP, schedule_a, "first.pt"),
        ("split", mesh_b, STEPS, schedule_b, "second.pt"),
    ):
        job = _job(tmp_path, name, mesh, total, schedule, backend)
        run_distributed(_train, 2, job, out, tmp_dir=tmp_path, timeout=timeout, backend=backend)
    straight, second = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "second.pt")
    assert len(second["losses"]) == STEPS  # the resumed run reports the loaded losses, then its own
    torch.testing.assert_close(
        torch.tensor(second["losses"][STOP:]), torch.tensor(straight["losses"][STOP:]), rtol=1e-5, atol=0
    )
    resumed_steps = range(STOP + 1, STEPS + 1)
    assert [second["lrs"][s] for s in resumed_steps] == pytest.approx(
        [straight["lrs"][s] for s in resumed_steps]
    )
    assert straight["biases"] and straight["biases"].keys() == second["biases"].keys()
    assert any(b.abs().sum() > 0 for b in straight["biases"].values()), "the bias never moved"
    for key, bias in straight["biases"].items():
        assert torch.equal(second["biases"][key], bias), (key, second["biases"][key], bias)
