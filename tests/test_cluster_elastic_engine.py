"""Elastic training with the real engine (`d9d.engine.launch:run_rank`) on a simulated two-node Ray cluster
(ray.cluster_utils.Cluster): a tiny Qwen3-MoE on two data-parallel ranks, one per node. A node is lost →
the job goes on with one rank and the same global batch (twice the gradient accumulation) → a node joins →
it is back on two ranks at the next commit.

Against an uninterrupted two-rank run of the engine's bare-process path:
- the steps trained before the loss are equal bit for bit (same layout, same reduction order);
- the steps after it agree within rtol 1e-5 / atol 1e-6 (2e-8 relative seen): on one rank the microbatch
  gradients are summed in another order than two ranks' accumulations plus their reduce-scatter, and
  AdamW carries the float32 rounding difference on;
- every step trained the same global samples, in the same order, as the data provider's global index says:
  each attempt's first drawn step is the step after the commit it resumed from (the data position comes
  from the checkpoint, not from the step counter), and the run's final history is samples [(s-1)G, sG) at
  step s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from d9d.cluster import JobState, TrainingJob, build_job
from tests.cluster_fixtures import bare_engine_rank
from tests.elastic_fixtures import samples_by_attempt
from tests.harness import run_distributed

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

STEPS = 14  # room after the node returns: the grow lands at a commit with steps left to train
BATCH = 4
_FAST_HEALTH = {
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 2,
    "health_check_initial_delay_ms": 0,
}
_ARCH = {
    "vocab_size": 32,
    "hidden_size": 16,
    "num_layers": 1,
    "num_attention_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 8,
    "intermediate_size": 32,
    "moe_intermediate_size": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "expert_bias": True,
    "router_aux_loss_coef": 0.01,
}


def _engine(run_dir: Path, sample_log: Path) -> dict[str, Any]:
    return {
        "run": {"name": "elastic-moe", "dir": str(run_dir)},
        "mesh": {"data_parallel_shard": 2},
        "batching": {"global_batch_size": BATCH, "microbatch_size": 1},
        "trainer": {"total_steps": STEPS},
        "model": {"provider": "qwen3_moe", "options": {"architecture": _ARCH}},
        "data": {
            "provider": "tests.elastic_fixtures:LoggedIndexData",
            "options": {"log_dir": str(sample_log)},
        },
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3, "weight_decay": 0.01}},
        "checkpointing": {"period": 2, "keep_last": 2},
        "logging": {"progress_bar": "off", "tracker": {"kind": "null"}},
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": _FAST_HEALTH},
    )
    c.add_node(num_cpus=1)
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _wait(job: TrainingJob, predicate: Any, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while not predicate(status := job.status()):
        assert time.monotonic() < deadline, f"timed out; status {status}"
        time.sleep(0.05)
    return status


def test_real_engine_moe_shrinks_on_node_loss_and_grows_back(cluster: Cluster, tmp_path: Path) -> None:
    run_distributed(bare_engine_rank, 2, _engine(tmp_path / "bare", tmp_path / "bare-samples"), timeout=120)
    reference: list[float] = torch.load(tmp_path / "bare" / "losses.pt")

    run_dir, sample_log = tmp_path / "ray", tmp_path / "ray-samples"
    config = {
        **_engine(run_dir, sample_log),
        "cluster": {
            "min_workers": 1,
            "max_workers": 2,
            "placement_timeout_s": 10,
            "restart_backoff_s": 0.1,
            "heartbeat_timeout_s": 10,
        },
    }
    job = TrainingJob(build_job(config)).start()
    _wait(job, lambda s: s.step >= 3)
    job.pause()  # hold the ranks at a step boundary, so the loss lands mid-run at any machine speed
    _wait(job, lambda s: s.state is JobState.PAUSED)
    assert job.status().world_size == 2
    victim = next(n for n in cluster.worker_nodes if n is not cluster.head_node)
    cluster.remove_node(victim, allow_graceful=False)
    _wait(job, lambda s: s.state is JobState.PAUSED and s.world_size == 1)  # restarted, still paused
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    # The coordinator grows at a commit that sees the room in Ray's resource view, which lags the node's
    # registration; the few steps left after the resume must not all pass before it shows.
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0.0) < 1.0:
        assert time.monotonic() < deadline, f"the added node's CPU never showed: {ray.available_resources()}"
        time.sleep(0.05)
    job.resume()
    summary = job.result(timeout=240)

    story = (
        f"world sizes {summary.world_sizes}, resumed from {summary.resumed_from}, failures {summary.failures}"
    )
    assert summary.status == "finished", f"{summary.error}; {story}"
    assert summary.world_sizes == [2, 1, 2] and summary.resizes == 1 and len(summary.failures) == 1, story
    shrunk_at, grown_at = summary.resumed_from[1], summary.resumed_from[2]
    assert shrunk_at is not None and grown_at is not None and 0 < shrunk_at < grown_at < STEPS, story

    losses = [summary.losses[s] for s in range(1, STEPS + 1)]
    assert losses[:shrunk_at] == reference[:shrunk_at]  # bitwise: trained before the loss, on two ranks
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)

    drawn = samples_by_attempt(sample_log, run_dir)
    assert sorted(drawn) == [0, 1, 2], story
    for attempt, resumed in enumerate(summary.resumed_from):
        assert min(drawn[attempt]) == (resumed or 0) + 1, (attempt, sorted(drawn[attempt]))
    # The run's final history: each step as the last attempt that trained it drew it.
    final = {s: drawn[0][s] for s in range(1, shrunk_at + 1)}
    final |= {s: drawn[1][s] for s in range(shrunk_at + 1, grown_at + 1)}
    final |= {s: drawn[2][s] for s in range(grown_at + 1, STEPS + 1)}
    assert final == {s: list(range((s - 1) * BATCH, s * BATCH)) for s in range(1, STEPS + 1)}
    drift = max(abs(a - b) / b for a, b in zip(losses, reference, strict=True))
    print(f"{story}; largest relative loss difference {drift:.1e}")
