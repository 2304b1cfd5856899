"""The real engine (`d9d.engine.launch:run_rank`) under Ray rank actors, end to end, against the engine's own
bare-process path: a data-parallel run that is paused, loses a rank while paused, restarts still paused and
finishes with losses equal bit for bit. (The 4-rank Qwen3-MoE demo runs in test_cluster_cli.py.)"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from d9d.cluster import JobState, TrainingJob, build_job
from d9d.cluster.names import NAMESPACE, rank_name
from tests.cluster_fixtures import bare_engine_rank
from tests.harness import run_distributed

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300), pytest.mark.usefixtures("_ray")]

STEPS = 30


def _engine_config(run_dir: Path) -> dict[str, Any]:
    return {
        "run": {"name": "engine-e2e", "dir": str(run_dir)},
        "mesh": {"data_parallel_replicate": 2},
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": STEPS},
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider"},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "tests.engine_fixtures:TokenCETask"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-2, "weight_decay": 0.01}},
        "checkpointing": {"period": 5, "keep_last": 2},
        "logging": {"progress_bar": "off", "tracker": {"kind": "null"}},
    }


def _wait(job: TrainingJob, predicate, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while not predicate(status := job.status()):
        assert time.monotonic() < deadline, f"timed out; status {status}"
        time.sleep(0.05)
    return status


def test_real_engine_survives_a_rank_loss_while_paused(tmp_path: Path) -> None:
    run_distributed(bare_engine_rank, 2, _engine_config(tmp_path / "bare"), timeout=120)
    reference = torch.load(tmp_path / "bare" / "losses.pt")

    job_dict = {**_engine_config(tmp_path / "ray"), "cluster": {"restart_backoff_s": 0.1}}
    job = TrainingJob(build_job(job_dict)).start()
    _wait(job, lambda s: s.step >= 7)
    job.pause()
    paused = _wait(job, lambda s: s.state is JobState.PAUSED)
    time.sleep(1.0)
    assert job.status().step < STEPS, "the run finished before it could be paused"
    ray.kill(ray.get_actor(rank_name("engine-e2e", 1), namespace=NAMESPACE))
    _wait(job, lambda s: s.attempt == 1 and s.state is JobState.PAUSED)  # still paused after the restart
    job.resume()
    summary = job.result(timeout=180)

    assert paused.step >= 7
    assert summary.status == "finished", summary.error
    assert summary.restarts == 1 and summary.resumed_from[1] is not None and summary.resumed_from[1] % 5 == 0
    assert [summary.losses[s] for s in range(1, STEPS + 1)] == reference


def test_sleep_and_wake_through_the_client(tmp_path: Path) -> None:
    """pause → sleep → wake (still paused) → resume, on the real engine: the losses are those of a run that
    never slept, and the status and metrics say what the ranks did."""

    def config(run_dir: Path) -> dict[str, Any]:
        raw = _engine_config(run_dir)
        return {**raw, "run": {**raw["run"], "name": "engine-sleep"}, "mesh": {}}

    run_distributed(bare_engine_rank, 1, config(tmp_path / "bare"), timeout=120)
    reference = torch.load(tmp_path / "bare" / "losses.pt")

    job = TrainingJob(build_job(config(tmp_path / "ray"))).start()
    _wait(job, lambda s: s.step >= 3)
    job.pause()
    paused = _wait(job, lambda s: s.state is JobState.PAUSED)
    assert paused.step < STEPS and not paused.asleep, "the run finished before it could be paused"
    job.sleep()
    asleep = _wait(job, lambda s: s.asleep)
    assert asleep.state is JobState.PAUSED and asleep.step == paused.step
    job.wake()
    awake = _wait(job, lambda s: not s.asleep)
    assert awake.state is JobState.PAUSED and awake.step == paused.step  # awake, still paused
    job.resume()
    summary = job.result(timeout=180)

    assert summary.status == "finished", summary.error
    assert [summary.losses[s] for s in range(1, STEPS + 1)] == reference
    points, _ = job.poll_metrics(0.0)
    sleeps = [p for p in points if p.kind == "health" and "asleep" in p.values]
    assert [(p.step, p.values["asleep"]) for p in sleeps] == [(paused.step, 1.0), (paused.step, 0.0)]
    assert sleeps[0].values["offloaded_bytes"] > 0
    assert not job.status().asleep
