"""Multi-node behaviour on a simulated Ray cluster (ray.cluster_utils.Cluster: one raylet per "node").

- no shared storage: ranks on different nodes keep checkpoints in their own scratch directories and save
  and restore only through the coordinator;
- node loss: the job shrinks to the data-parallel degree that still fits, keeps the global batch, trains
  every sample exactly once, and grows back at a checkpoint boundary when a node joins again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from d9d.cluster import JobState, TrainingJob, build_job
from d9d.cluster.names import NAMESPACE, rank_name
from d9d.engine.checkpoint import read_latest, verify_manifest
from tests.cluster_fixtures import reference_losses, toy_job, trained_samples, wait_for_step

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

# Ray notices a lost raylet through its health check; make it quick, as docs/deploy.md recommends.
_FAST_HEALTH = {
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 2,
    "health_check_initial_delay_ms": 0,
}
_HEARTBEAT_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": _FAST_HEALTH},
    )
    c.add_node(num_cpus=2)
    c.add_node(num_cpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _wait_state(job: TrainingJob, predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(job.status()):
        assert time.monotonic() < deadline, f"timed out; status {job.status()}"
        time.sleep(0.05)


def test_no_shared_storage_saves_and_restores_through_coordinator(cluster: Cluster, tmp_path: Path) -> None:
    steps = 10
    scratch = tmp_path / "scratch"
    storage = {"kind": "coordinator", "local_dir": str(scratch), "chunk_mb": 1}
    job = toy_job(
        "noshare",
        tmp_path / "run",
        steps=steps,
        model={"options": {"step_sleep_s": 0.3}},
        cluster={"storage": storage, "placement_strategy": "SPREAD"},
    )
    reference = reference_losses(job, world=2)
    tj = TrainingJob(build_job(job)).start()
    wait_for_step(tj, 5)
    ray.kill(ray.get_actor(rank_name("noshare", 1), namespace=NAMESPACE))
    summary = tj.result(timeout=180)

    assert summary.status == "finished", summary.error
    assert summary.restarts == 1 and summary.resumed_from[1] is not None
    # Rank 1 never writes engine.pt or rank 0's shard: resuming bit-exactly needs both from the coordinator.
    assert [summary.losses[s] for s in range(1, steps + 1)] == reference
    store = tmp_path / "run" / "checkpoints"
    latest = read_latest(store)
    assert latest is not None and latest.name.endswith(f"{steps:08d}")
    assert sorted(p.name for p in latest.iterdir()) == [
        "engine.pt",
        "manifest.json",
        "shard-00000.pt",
        "shard-00001.pt",
    ]
    verify_manifest(latest)
    rank1 = scratch / "noshare" / "rank-00001"
    assert sorted(p.name for p in (rank1 / latest.name).iterdir()) == ["shard-00001.pt"]
    assert not (scratch / "noshare" / "rank-00000" / latest.name / "shard-00001.pt").exists()


def test_node_loss_shrinks_keeps_global_batch_and_grows_back(cluster: Cluster, tmp_path: Path) -> None:
    steps, batch = 16, 8
    job = toy_job(
        "elastic",
        tmp_path / "run",
        world=4,
        steps=steps,
        model={"options": {"step_sleep_s": 0.25}},
        cluster={
            "min_workers": 2,
            "max_workers": 4,
            "placement_timeout_s": 30,
            "heartbeat_timeout_s": _HEARTBEAT_TIMEOUT_S,
        },
    )
    reference = reference_losses(job, world=1)  # one process, accumulation 8
    tj = TrainingJob(build_job(job)).start()
    wait_for_step(tj, 4)
    assert tj.status().world_size == 4

    victim = next(n for n in cluster.worker_nodes if n is not cluster.head_node)
    lost = time.monotonic()
    cluster.remove_node(victim, allow_graceful=False)
    _wait_state(job=tj, predicate=lambda s: s.state not in (JobState.RUNNING, JobState.PAUSED))
    noticed_s = time.monotonic() - lost
    # Noticed as a failed rank (its actor died, or a survivor's collective broke), not by the heartbeat
    # or step timeouts that would catch it otherwise. How fast is a benchmark's business
    # (benchmarks/node_loss.py).
    reason = tj.status().last_failure or ""
    assert reason.startswith("rank ") and "no heartbeat" not in reason, reason
    assert noticed_s < _HEARTBEAT_TIMEOUT_S, f"noticed after {noticed_s:.1f}s: {reason}"

    # Running on what is left; hold the job while a node joins, so the grow lands at a checkpoint.
    _wait_state(tj, lambda s: s.state is JobState.RUNNING and s.world_size == 2)
    tj.pause()
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    tj.resume()
    summary = tj.result(timeout=240)

    story = f"world sizes {summary.world_sizes}, resizes {summary.resizes}, failures {summary.failures}"
    assert summary.status == "finished", f"{summary.error}; {story}"
    assert summary.world_sizes == [4, 2, 4], story
    assert summary.resizes == 1 and len(summary.failures) == 1, story
    assert len(summary.recovery_times_s) == 1, story
    # Same global batch at every DP degree: the curve matches a single process up to summation order.
    assert [summary.losses[s] for s in range(1, steps + 1)] == pytest.approx(reference, rel=1e-4)
    # Every global sample trained exactly once, in order, across all three layouts.
    assert trained_samples(tmp_path / "run") == {
        s: list(range((s - 1) * batch, s * batch)) for s in range(1, steps + 1)
    }
