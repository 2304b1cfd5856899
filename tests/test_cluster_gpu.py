"""GPU rank actors (run on the device machine): one GPU bundle per rank, NCCL process groups, the real
engine on CUDA, and a restart after a rank is killed while its peers sit in NCCL."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch

from d9d.cluster import JobState, TrainingJob, build_job

pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.timeout(600)]

STEPS = 30


@pytest.fixture(scope="module")
def gpus() -> Iterator[int]:
    n = min(2, torch.cuda.device_count())
    ray.init(address="local", num_cpus=n + 1, num_gpus=n, include_dashboard=False, log_to_driver=False)
    yield n
    ray.shutdown()


def test_real_engine_on_gpu_ranks_restarts_after_a_kill(gpus: int, tmp_path: Path) -> None:
    job_dict = {
        "run": {"name": "gpu-e2e", "dir": str(tmp_path)},
        "mesh": {"data_parallel_replicate": gpus},
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": STEPS},
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider"},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "tests.engine_fixtures:TokenCETask"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-2}},
        "checkpointing": {"period": 5},
        "logging": {"progress_bar": "off", "tracker": {"kind": "null"}},
        "cluster": {"resources": {"cpus": 1, "gpus": 1}, "restart_backoff_s": 0.1},
    }
    job = TrainingJob(build_job(job_dict)).start()
    deadline = time.monotonic() + 300
    while job.status().step < 7:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    job.pause()
    while job.status().state is not JobState.PAUSED:
        time.sleep(0.05)
    time.sleep(1.0)
    job.kill_rank(gpus - 1)
    while not (job.status().attempt == 1 and job.status().state is JobState.PAUSED):
        assert time.monotonic() < deadline, job.status()
        time.sleep(0.05)
    job.resume()
    summary = job.result(timeout=300)

    assert summary.status == "finished", summary.error
    assert summary.restarts == 1 and summary.steps == STEPS
    assert summary.losses[STEPS] < summary.losses[1]
    used = {
        p.rank
        for p in TrainingJob.attach("gpu-e2e").metrics(timeout=10)
        if p.kind == "health" and p.values.get("cuda_max_allocated_bytes", 0) > 0
    }
    assert used == set(range(gpus))  # every rank trained on its own CUDA device
