"""The built-in Qwen3-MoE provider and causal-LM task through the engine, on 1 and 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import ConfigError, parse_config
from d9d.engine.launch import run_rank
from d9d.engine.runtime import MetricPoint, RankRuntime
from tests.harness import RankEnv, run_distributed

ARCH = {
    "vocab_size": 32,
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "expert_bias": True,
    "router_aux_loss_coef": 0.01,
}


def _config(run_dir: Path, dp: int, ep: int = 1, steps: int = 30) -> dict[str, Any]:
    return {
        "run": {"name": "moe", "dir": str(run_dir)},
        "mesh": {"data_parallel_replicate": dp, "expert_parallel": ep},
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": steps},
        "logging": {"progress_bar": "off", "period": 5},
        "checkpointing": {"save_at_end": False},
        "model": {"provider": "qwen3_moe", "options": {"architecture": ARCH}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
    }


def _train(env: RankEnv, dp: int, ep: int = 1, steps: int = 30) -> None:
    config = parse_config(_config(env.tmp_dir / f"dp{dp}ep{ep}", dp, ep, steps))
    points: list[MetricPoint] = []
    reporter = LocalRunReporter(config.checkpoint_dir, 1, points.append)
    runtime = RankRuntime(
        rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=config.run_dir
    )
    result = run_rank(config, runtime, reporter)
    if env.rank == 0:
        train = [p for p in points if p.kind == "train"]
        torch.save(
            {"losses": list(result.losses), "keys": sorted(train[-1].values)},
            env.tmp_dir / f"dp{dp}ep{ep}.pt",
        )


@pytest.mark.distributed
def test_qwen3_moe_pretraining_on_1_2_and_4_ranks(tmp_path: Path) -> None:
    """30 steps on one rank, where the loss falls; dp2 and 4 ranks with experts sharded 2-way (expert domain
    ep_replicate 2 x ep_shard 2) follow its first 4 steps (each step syncs gradients, sums the expert loads
    and moves the expert bias, so 4 steps check every mechanism a longer run would; the multi-rank steps are
    most of this test's time)."""
    run_distributed(_train, 1, 1, tmp_dir=tmp_path, timeout=300)
    run_distributed(_train, 2, 2, 1, 4, tmp_dir=tmp_path, timeout=300)
    run_distributed(_train, 4, 4, 2, 4, tmp_dir=tmp_path, timeout=400)
    one = torch.load(tmp_path / "dp1ep1.pt")
    losses = torch.tensor(one["losses"])
    assert len(losses) == 30
    assert losses[-5:].mean() < 0.75 * losses[:5].mean(), losses
    for name in ("dp2ep1", "dp4ep2"):
        other = torch.tensor(torch.load(tmp_path / f"{name}.pt")["losses"])
        # float32 summation order differs across layouts; AdamW amplifies it slowly
        assert len(other) == 4
        torch.testing.assert_close(other, losses[:4], rtol=1e-4, atol=1e-5, msg=name)
    assert "moe/model.layers.0.mlp/max_load_ratio" in one["keys"]
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(one["keys"])


def test_bad_architecture_fails_at_config_time(tmp_path: Path) -> None:
    bad = _config(tmp_path, 1)
    bad["model"]["options"]["architecture"] = {**ARCH, "num_experts_per_tok": 9}
    with pytest.raises(ConfigError, match=r"model\.options.*num_experts_per_tok=9 exceeds num_experts=4"):
        parse_config(bad)
    bad["model"]["options"] = {}
    with pytest.raises(ConfigError, match="give `architecture`"):
        parse_config(bad)


def _train_and_export(env: RankEnv) -> None:
    import transformers

    from d9d.core import DeviceMeshParameters, DistributedContext
    from d9d.engine.trainer import Trainer

    dense = {
        k: v
        for k, v in ARCH.items()
        if k
        in {
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        }
    }
    raw = _config(env.tmp_dir / "export", 1)
    raw["model"] = {"provider": "qwen3", "options": {"architecture": dense}}
    raw["trainer"] = {"total_steps": 3}
    raw["checkpointing"] = {"save_at_end": False, "export_hf_dir": str(env.tmp_dir / "hf")}
    config = parse_config(raw)
    ctx = DistributedContext.create(DeviceMeshParameters(), backend="gloo")
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 1))
    trainer.setup()
    trainer.train()
    tokens = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = trainer.modules[0](input_ids=tokens)["logits"]
        hf = transformers.AutoModelForCausalLM.from_pretrained(env.tmp_dir / "hf").eval()
        theirs = hf(input_ids=tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_trained_model_exports_to_transformers(tmp_path: Path) -> None:
    run_distributed(_train_and_export, 1, tmp_dir=tmp_path, timeout=180)
