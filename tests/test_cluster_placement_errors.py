"""A run the cluster cannot hold fails with one line naming what it asked for and what the cluster has: at
once on the local Ray instance `d9d train` starts (no node can join it; nothing is started), after
`cluster.placement_timeout_s` on a cluster (nodes may still join), never with the coordinator's traceback."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from d9d.cluster import TrainingJob
from d9d.cluster.config import RankResources
from d9d.cluster.follow import follow
from d9d.cluster.placement import placement_shortfall
from d9d.cluster.spec import build_job
from tests.cluster_fixtures import toy_job

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]


def _node(cpus: float, gpus: float = 0.0, *, alive: bool = True) -> dict[str, object]:
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return {"Alive": alive, "Resources": resources}


def test_the_shortfall_names_the_request_and_what_the_cluster_has() -> None:
    gpu = RankResources(cpus=1, gpus=1)
    said = placement_shortfall([_node(16)], gpu, [2])
    assert said == (
        "needs 2 rank bundles of 1 CPU + 1 GPU each (cluster.resources); the cluster's 1 alive node has "
        "16 CPU, 0 GPU in all, room for 0 such bundles (each must fit on one node)"
    )
    # Room on no single node: 3 + 3 CPUs hold two 2-CPU bundles, not three; a dead node counts for nothing.
    said = placement_shortfall([_node(3), _node(3), _node(64, alive=False)], RankResources(cpus=2), [4, 3])
    assert said.startswith("needs 4 (or at least 3) rank bundles of 2 CPU each")
    assert "2 alive nodes have 6 CPU in all, room for 2 such bundles" in said
    # Room, but held by others at the moment.
    said = placement_shortfall([_node(4)], RankResources(cpus=1), [4], available={"CPU": 1.0})
    assert said.endswith("room for 4 such bundles, 1 of them free now (other actors or jobs hold the rest)")


@pytest.mark.ray
@pytest.mark.usefixtures("_ray")
def test_a_run_the_cluster_cannot_hold_fails_in_one_line(tmp_path: Path) -> None:
    """The module's Ray instance has 3 CPUs and no GPU; the run asks for 2 GPU ranks."""
    job = toy_job(
        "no-gpus", tmp_path, cluster={"resources": {"cpus": 1, "gpus": 1}, "placement_timeout_s": 1}
    )
    handle = TrainingJob(build_job(job)).start()
    console = io.StringIO()
    summary = follow(handle, out=console, interactive=False)

    assert summary.status == "failed"
    assert summary.error == (
        "run no-gpus could not be placed within cluster.placement_timeout_s=1s: it needs 2 rank bundles of "
        "1 CPU + 1 GPU each (cluster.resources); the cluster's 1 alive node has 3 CPU, 0 GPU in all, room "
        "for 0 such bundles (each must fit on one node)"
    )
    said = console.getvalue()
    assert "Traceback" not in said and "NoResources" not in said, said
    # Said as the wait begins (an autoscaler may still add a node), and once more as the run's error.
    assert "[d9d] waiting up to cluster.placement_timeout_s=1s for room: the run needs 2 rank bundles" in said
    assert f"[d9d] {summary.error}\n" in said


def test_d9d_train_on_its_local_instance_refuses_a_run_it_cannot_hold_before_starting_it(
    tmp_path: Path,
) -> None:
    """No node can join the instance `d9d train` starts: a run asking for more GPUs than this machine has
    is refused before the coordinator or any rank starts, in one line (exit status 2)."""
    job = toy_job("too-many-gpus", tmp_path / "run", cluster={"resources": {"cpus": 1, "gpus": 1}})
    job["mesh"] = {"data_parallel_shard": 64}
    job["batching"] = {"global_batch_size": 64, "microbatch_size": 1}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-m", "d9d.cli.main", "train", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )

    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("d9d train:")]
    assert line.startswith(
        "d9d train: run too-many-gpus cannot be placed on the local Ray instance d9d started: it needs 64 "
        "rank bundles of 1 CPU + 1 GPU each (cluster.resources); the cluster's 1 alive node has "
    ), line
    assert "Traceback" not in out.stdout + out.stderr
    assert not (tmp_path / "run" / "coordinator.json").exists()  # no coordinator ever ran
    assert "[d9d] run too-many-gpus" not in out.stdout
