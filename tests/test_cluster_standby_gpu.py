"""A GPU job's warm standby (docs/cluster.md, "Warm standby ranks"): it holds no GPU of its own but starts
CUDA next to the job's ranks, and a restart hands it the GPU the failed rank drove; the restarted run ends
with the losses of a run that never failed."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from d9d.cluster import TrainingJob
from d9d.cluster.names import NAMESPACE, rank_name
from d9d.cluster.rank import rank_log_path
from d9d.cluster.spec import build_job

pytestmark = [pytest.mark.gpu, pytest.mark.ray]
STEPS = 12


@pytest.fixture(scope="module")
def _ray() -> Iterator[None]:
    ray.init(address="local", num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _job(name: str, run_dir: Path, standby: int) -> dict[str, Any]:
    return {
        "run": {"name": name, "dir": str(run_dir)},
        "batching": {"global_batch_size": 8, "microbatch_size": 4},
        "trainer": {"total_steps": STEPS},
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider", "options": {"width": 64}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "tests.engine_fixtures:TokenCETask"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-3}},
        "checkpointing": {"period": 2, "keep_last": 2},
        "compile": {"enabled": False},
        "logging": {"progress_bar": "off", "tracker": {"kind": "null"}},
        "cluster": {"resources": {"cpus": 2, "gpus": 1}, "standby_ranks": standby, "restart_backoff_s": 0},
    }


def _gpu_pids() -> set[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {int(line) for line in out.split()}


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("_ray")
def test_gpu_restart_drives_the_failed_ranks_gpu_from_the_warm_standby(tmp_path: Path) -> None:
    straight = TrainingJob(build_job(_job("gpu-straight", tmp_path / "straight", 0))).start().result(120)
    assert straight.status == "finished", straight.error

    run_dir = tmp_path / "standby"
    job = TrainingJob(build_job(_job("gpu-standby", run_dir, 1))).start()
    paused = False
    for point in job.metrics(timeout=120):  # hold the run until its standby is ready
        if not paused and point.kind == "train" and point.step >= 3:
            job.pause()
            paused = True
        if point.kind == "health" and point.values.get("standby_ranks_ready") == 1.0:
            break
    assert paused
    on_gpu = _gpu_pids()  # the rank and the standby, each with its own CUDA context on the one GPU
    ray.kill(ray.get_actor(rank_name("gpu-standby", 0), namespace=NAMESPACE))
    for point in job.metrics(timeout=120):
        if point.rank == -1 and "world_size" in point.values:  # the restart's attempt began
            break
    job.resume()
    summary = job.result(timeout=180)

    assert summary.status == "finished", summary.error
    assert summary.restarts == 1 and summary.standby_ranks_used == [0, 1]
    standby_pid = summary.standby_pids[0]
    assert standby_pid in on_gpu  # its CUDA context existed before the failure
    starts = re.findall(r"rank 0 of 1, attempt (\d+), pid (\d+)", rank_log_path(run_dir, 0).read_text())
    assert [(int(a), int(p)) for a, p in starts][-1] == (1, standby_pid)
    assert [summary.losses[s] for s in range(1, STEPS + 1)] == [
        straight.losses[s] for s in range(1, STEPS + 1)
    ]
