"""A node that Ray drains (a spot VM's preemption notice, a scale-down, `ray drain-node`) while it runs a
rank or the coordinator is a preemption (issue 29, point 4): the coordinator stops the run at the next
step boundary, which is committed, within `cluster.preemption_grace_s`; `d9d train` exits with PREEMPTED
and `d9d resume` continues. On its own `ray start --head` cluster (non-default ports): a drained node takes
no new work, so no other test may share it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml

from d9d.cli import exit_codes
from d9d.cli.main import main
from d9d.cluster.control.journal import read_journal
from d9d.cluster.drain import DrainNotice, draining_nodes, notice
from d9d.engine.checkpoint import read_latest
from tests.cluster_fixtures import reference_losses, toy_job, trained_samples
from tests.test_cluster_cli import BIN, Head, _env, ray_head  # noqa: F401


def test_only_the_runs_own_nodes_count_and_the_earliest_deadline_is_kept() -> None:
    draining = {"aa" * 28: 1_000.0, "bb" * 28: math.inf, "cc" * 28: 900.0}
    assert notice(draining, ["dd" * 28, "ee" * 28], "ff" * 28) is None  # someone else's nodes
    found = notice(draining, ["dd" * 28, "aa" * 28, "bb" * 28, "aa" * 28, ""], "dd" * 28)
    assert found == DrainNotice(("aa" * 28, "bb" * 28), (1, 2, 3), False, 1_000.0)
    assert found.reason(now=970.4) == (
        "preempted: nodes aaaaaaaaaaaa, bbbbbbbbbbbb (ranks 1, 2, 3) are draining (Ray; to be killed in 30s)"
    )
    coordinator = notice({"bb" * 28: math.inf}, ["aa" * 28], "bb" * 28)
    assert coordinator is not None and coordinator.ranks == () and coordinator.coordinator
    assert (
        coordinator.reason()
        == "preempted: node bbbbbbbbbbbb (the coordinator) is draining (Ray; no deadline given)"
    )


def test_a_ray_that_does_not_tell_drains_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray._private import state

    def gone() -> dict[str, int]:
        raise AttributeError("get_draining_nodes")

    monkeypatch.setattr(state.state, "get_draining_nodes", gone)
    assert draining_nodes() is None


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_a_drained_node_stops_the_run_at_a_committed_step_and_d9d_resume_continues(
    ray_head: Head,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`ray drain-node` on the node of both ranks and the coordinator (a 120 s preemption notice) once step
    5 is committed (every 5 steps): the run stops at the step the ranks are at, commits it, and `d9d train`
    exits with PREEMPTED well within the grace; `d9d resume` (here on a fresh local Ray: the drained
    cluster takes no new work) trains the rest, the losses bit for bit those of an uninterrupted run.

    The driver is a `d9d train` process of its own: Ray fixes a process's authentication mode once, and
    this cluster's token is not that of the local instances the other tests start in this process."""
    steps = 60
    run_dir = tmp_path / "run"
    job = toy_job(
        "drained",
        run_dir,
        steps=steps,
        model={"options": {"step_sleep_s": 0.25}},
        checkpointing={"period": 5, "keep_last": 3},
    )
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    driver = subprocess.Popen(
        [sys.executable, "-m", "d9d.cli.main", "train", str(job_file), "--address", ray_head.gcs],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while (latest := read_latest(run_dir / "checkpoints")) is None:  # step 5 committed
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
            time.sleep(0.2)
        journal = read_journal(run_dir)
        assert journal is not None and journal.node_id  # the coordinator's node: the cluster's only one
        drain = subprocess.run(
            [
                str(BIN / "ray"),
                "drain-node",
                f"--address={ray_head.gcs}",
                f"--node-id={journal.node_id}",
                "--reason=DRAIN_NODE_REASON_PREEMPTION",
                "--reason-message=spot preemption",
                "--deadline-remaining-seconds=120",
            ],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert drain.returncode == 0, drain.stderr
        drained_at = time.time()  # the GCS took the drain request
        out, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()

    assert driver.returncode == exit_codes.PREEMPTED, (out, err)
    first = json.loads((run_dir / "run_summary.json").read_text())
    assert first["status"] == "stopped", first
    reason = first["stop_reason"]
    assert reason.startswith(
        f"preempted: node {journal.node_id[:12]} (ranks 0, 1 and the coordinator) is "
    ), reason
    assert "draining (Ray; to be killed in " in reason and not reason.endswith("killed")  # stopped in time
    assert first["ended_at"] - drained_at < 25.0  # cluster.preemption_grace_s
    assert any(n.startswith(reason) for n in first["notices"])  # said on the console as it happened
    stopped_at = first["steps"]
    assert latest.name.endswith("00000005") and 5 < stopped_at < steps, stopped_at
    newest = read_latest(run_dir / "checkpoints")
    assert newest is not None and newest.name.endswith(f"{stopped_at:08d}")  # the step it stopped at
    assert f"d9d train: run drained stopped at step {stopped_at} ({reason}); `d9d resume {run_dir}`" in err

    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        assert main(["resume", str(run_dir)]) == exit_codes.FINISHED
    finally:
        ray.shutdown()
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "finished" and summary["resumed_from"] == [stopped_at]
    launches = summary["launches"]
    losses = {**launches[0]["losses"], **launches[1]["losses"]}
    assert [losses[str(s)] for s in range(1, steps + 1)] == reference_losses(job, world=2)
    batch = 8
    assert trained_samples(run_dir) == {
        s: list(range((s - 1) * batch, s * batch)) for s in range(1, steps + 1)
    }
