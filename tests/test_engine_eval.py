"""Evaluation during training: eval/* metric points, exact across a resume, reduced over DP ranks, and the
config checks that refuse what it cannot do."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import ConfigError, parse_config
from d9d.engine.launch import run_rank
from d9d.engine.runtime import MetricPoint, RankRuntime
from tests.engine_fixtures import TinyLM, make_hf_qwen3, sample_tokens
from tests.harness import RankEnv, run_distributed
from tests.test_engine_loop import _config, _final_params

EVAL_BATCH, EVAL_BATCHES = 4, 3


def _eval_config(run_dir: Path, total_steps: int, **extra: Any) -> dict[str, Any]:
    config = _config(run_dir, trainer__total_steps=total_steps, checkpointing__period=None, **extra)
    config["eval"] = {
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "batch_size": EVAL_BATCH,
        "batches": EVAL_BATCHES,
        "period": 3,
    }
    return config


def _train(env: RankEnv, run_dir: Path, out: str, total_steps: int, dp: int, workers: int) -> None:
    extra: dict[str, Any] = {"data_loading__num_workers": workers}
    if dp > 1:
        extra["mesh__data_parallel_replicate"] = dp
    config = parse_config(_eval_config(run_dir, total_steps, **extra))
    points: list[MetricPoint] = []
    reporter = LocalRunReporter(config.checkpoint_dir, 3, points.append)
    runtime = RankRuntime(rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=run_dir)
    result = run_rank(config, runtime, reporter)
    if env.rank == 0:
        evals = {p.step: p.values for p in points if p.kind == "eval"}
        torch.save({"evals": evals, "losses": list(result.losses)}, env.tmp_dir / out)
    else:
        assert not [p for p in points if p.kind == "eval"], "only rank 0 reports eval points"


def _reference_eval(run_dir: Path) -> float:
    """Mean token cross-entropy of the final checkpoint's weights over the eval set, computed directly."""
    model = TinyLM(16)
    model.load_state_dict(_final_params(run_dir))
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(EVAL_BATCH * EVAL_BATCHES):
            tokens = sample_tokens(i)
            logits = model(tokens[:-1].unsqueeze(0)).double()
            total += float(nn.functional.cross_entropy(logits[0], tokens[1:], reduction="sum"))
            count += len(tokens) - 1
    return total / count


def _straight_and_resumed(env: RankEnv, straight: Path, split: Path) -> None:
    """Three runs in one process (a spawn costs more than the runs): 8 steps; 4 steps, then on to 8."""
    _train(env, straight, "a.pt", 8, 1, 0)
    _train(env, split, "b1.pt", 4, 1, 0)
    # the second half also loads data on a background thread: the same batches, so the same numbers
    _train(env, split, "b2.pt", 8, 1, 1)


@pytest.mark.distributed
def test_eval_points_are_exact_across_a_resume(tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_distributed(_straight_and_resumed, 1, straight, split, tmp_dir=tmp_path)
    a = torch.load(tmp_path / "a.pt")
    b1, b2 = torch.load(tmp_path / "b1.pt"), torch.load(tmp_path / "b2.pt")
    assert sorted(a["evals"]) == [3, 6, 8]  # the period, and the end
    assert sorted(b1["evals"]) == [3, 4]
    assert sorted(b2["evals"]) == [6, 8]  # resumed from step 4: nothing re-evaluated
    assert b2["losses"] == a["losses"]
    for step, values in {**b1["evals"], **b2["evals"]}.items():
        if step in a["evals"]:
            assert values == a["evals"][step], f"eval at step {step} differs after the resume"
    final = a["evals"][8]
    assert set(final) == {"eval/loss", "eval/perplexity", "eval/tokens"}
    assert final["eval/tokens"] == EVAL_BATCH * EVAL_BATCHES * 8
    assert final["eval/perplexity"] == pytest.approx(math.exp(final["eval/loss"]), rel=1e-12)
    assert final["eval/loss"] == pytest.approx(_reference_eval(straight), rel=1e-5)
    # the model learns the counting pattern: held-out loss falls
    assert a["evals"][8]["eval/loss"] < a["evals"][3]["eval/loss"]


@pytest.mark.distributed
def test_eval_loss_is_reduced_over_data_parallel_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "dp2"
    run_distributed(_train, 2, run_dir, "dp.pt", 3, 2, 0, tmp_dir=tmp_path)
    evals = torch.load(tmp_path / "dp.pt")["evals"]
    assert sorted(evals) == [3]
    assert evals[3]["eval/tokens"] == EVAL_BATCH * EVAL_BATCHES * 8  # both ranks' halves counted
    assert evals[3]["eval/loss"] == pytest.approx(_reference_eval(run_dir), rel=1e-5)


def test_config_refuses_eval_it_cannot_run(tmp_path: Path) -> None:
    base = _eval_config(tmp_path, 4)
    v_shape = {**base, "mesh": {"pipeline_parallel": 2}, "pipelining": {"kind": "zbv"}}
    with pytest.raises(ConfigError, match=r"eval with mesh\.pipeline_parallel=2.*pipelining\.kind=zbv"):
        parse_config(v_shape, check_components=False)
    with pytest.raises(ConfigError, match=r"context parallelism \(mesh\.context_parallel_replicate"):
        parse_config({**base, "mesh": {"context_parallel_shard": 2}}, check_components=False)
    uneven = {**base, "eval": {**base["eval"], "batch_size": 3}, "mesh": {"data_parallel_shard": 2}}
    with pytest.raises(ConfigError, match=r"eval\.batch_size=3 is not divisible"):
        parse_config(uneven, check_components=False)
    bad_plugin = {**base, "eval": {**base["eval"], "data": {"provider": "tests.engine_fixtures:Nope"}}}
    with pytest.raises(ConfigError, match=r"eval\.data"):
        parse_config(bad_plugin)


def test_data_loading_config_says_what_the_background_loader_does(tmp_path: Path) -> None:
    base = _eval_config(tmp_path, 4)
    loading = {
        "data_loading": {"num_workers": 1, "prefetch_factor": 3},
    }
    assert parse_config({**base, **loading}, check_components=False).data_loading.prefetch_depth == 3
    assert parse_config(base, check_components=False).data_loading.prefetch_depth == 0
    threaded = {**base, "data_loading": {"num_workers": 1}}
    assert parse_config(threaded, check_components=False).data_loading.prefetch_depth == 2
    with pytest.raises(
        ConfigError, match=r"data_loading.*num_workers=4: data is made by one background thread"
    ):
        parse_config({**base, "data_loading": {"num_workers": 4}}, check_components=False)
    with pytest.raises(ConfigError, match=r"data_loading.*prefetch_factor only applies"):
        parse_config({**base, "data_loading": {"prefetch_factor": 2}}, check_components=False)


def _eval_job(run_dir: Path, mesh: dict[str, int], eval_section: dict[str, Any]) -> dict[str, Any]:
    """One training step of the source checkpoint in `run_dir/../hf` with `eval_section`; an update far
    below float32 resolution, so the weights stay the source checkpoint's and transformers gives the
    reference."""
    return {
        "run": {"name": run_dir.name, "dir": str(run_dir)},
        "mesh": mesh,
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": 1},
        "logging": {"progress_bar": "off"},
        "checkpointing": {"save_at_end": False},
        "model": {"provider": "qwen3", "options": {"source_checkpoint": str(run_dir.parent / "hf")}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "sgd", "options": {"lr": 1e-30}},
        "eval": eval_section,
    }


def _pipelined(env: RankEnv) -> None:
    run_dir = env.tmp_dir / "pp"
    eval_data = {"provider": "tests.engine_fixtures:GlobalIndexData"}
    config = _eval_job(run_dir, {"pipeline_parallel": 2}, {"data": eval_data, "batch_size": 2, "batches": 3})
    points: list[MetricPoint] = []
    reporter = LocalRunReporter(run_dir / "checkpoints", 1, points.append)
    runtime = RankRuntime(rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=run_dir)
    run_rank(parse_config(config), runtime, reporter)
    if env.rank == 0:
        torch.save([p.values for p in points if p.kind == "eval"], env.tmp_dir / "pp.pt")


@pytest.mark.distributed
def test_pipelined_eval_equals_transformers(tmp_path: Path) -> None:
    """pp2 under 1f1b: the eval set goes through both stages under the forward-only schedule (3 microbatches
    in flight), the loss is computed on the last stage and reduced: transformers' loss on the same tokens."""
    reference = make_hf_qwen3(tmp_path / "hf", num_layers=2).double()
    total = 0.0
    with torch.no_grad():
        for i in range(2 * 3):
            tokens = sample_tokens(i)
            logits = reference(input_ids=tokens[None, :-1]).logits[0]
            total += float(nn.functional.cross_entropy(logits, tokens[1:], reduction="sum"))
    run_distributed(_pipelined, 2, tmp_dir=tmp_path, timeout=200)
    (values,) = torch.load(tmp_path / "pp.pt")
    assert values["eval/tokens"] == 2 * 3 * 8
    assert values["eval/loss"] == pytest.approx(total / (2 * 3 * 8), rel=1e-5)


def _eval_runs_out(env: RankEnv) -> None:
    run_dir = env.tmp_dir / "short"
    # 3 samples, one per rank per batch: rank 0 gets 2 batches, rank 1 only 1 of the 2 asked for
    finite = {"provider": "tests.test_engine_inference_pp:FiniteSteps", "options": {"num_samples": 3}}
    config = _eval_job(
        run_dir, {"data_parallel_shard": 2}, {"data": finite, "batch_size": 2, "batches": 2, "period": 1}
    )
    reporter = LocalRunReporter(run_dir / "checkpoints", 1)
    runtime = RankRuntime(rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=run_dir)
    with pytest.raises(
        RuntimeError, match=r"eval.data gave \d of eval.batches=2 batches.*1 to 2 over the ranks"
    ):
        run_rank(parse_config(config), runtime, reporter)
    (env.tmp_dir / f"refused-{env.rank}").touch()


@pytest.mark.distributed
def test_an_eval_set_that_runs_out_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Under FSDP a rank that refused alone would leave the other in its forward's all-gather until the
    collectives time out; the ranks compare their batch counts first and all refuse."""
    make_hf_qwen3(tmp_path / "hf", num_layers=2)
    run_distributed(_eval_runs_out, 2, tmp_dir=tmp_path, timeout=120)
    assert (tmp_path / "refused-0").exists() and (tmp_path / "refused-1").exists()
