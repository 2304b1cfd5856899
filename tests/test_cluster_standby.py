"""Warm standby ranks and the recovery-phase split: a restart takes the standby's process instead of a cold
one, reproduces the failure-free losses bit for bit, and `run_summary.json` says where the recovery time
went."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import ray

from d9d.cluster import TrainingJob, checkpoints
from d9d.cluster.control.recovery import DETECT, PHASES, split
from d9d.cluster.names import NAMESPACE, rank_name
from d9d.cluster.rank import SETUP_BUILD, SETUP_LOAD, SETUP_PROCESS_GROUP, rank_log_path, setup_marks
from d9d.cluster.spec import build_job
from d9d.engine.checkpoint import step_dir_name
from d9d.engine.runtime import CheckpointFile, MetricPoint, RankCheckpointReport
from tests.cluster_fixtures import reference_losses, toy_job, trained_samples

STEPS = 10


def _attempt_pids(run_dir: Path, world: int) -> dict[int, dict[int, int]]:
    """attempt -> rank -> pid, from the header every rank writes to its log when it starts."""
    out: dict[int, dict[int, int]] = {}
    for rank in range(world):
        for m in re.finditer(
            r"rank (\d+) of \d+, attempt (\d+), pid (\d+)", rank_log_path(run_dir, rank).read_text()
        ):
            out.setdefault(int(m[2]), {})[int(m[1])] = int(m[3])
    return out


def _hold_until_standby_ready(job: TrainingJob) -> int:
    """Pause at the first step seen, resume once a standby reported ready; returns that step."""
    paused_at = None
    for point in job.metrics(timeout=120):
        if paused_at is None and point.kind == "train":
            job.pause()
            paused_at = point.step
        if point.kind == "health" and point.values.get("standby_ranks_ready") == 1.0:
            break
    assert paused_at is not None and paused_at < STEPS
    job.resume()
    return paused_at


@pytest.mark.ray
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_ray")
def test_restart_takes_the_warm_standby_and_reports_its_phases(tmp_path: Path) -> None:
    config = toy_job(
        "standby",
        tmp_path,
        steps=STEPS,
        model={"options": {"step_sleep_s": 0.3}},
        cluster={"standby_ranks": 1},
    )
    reference = reference_losses(config, world=2)
    job = TrainingJob(build_job(config)).start()
    # A standby starts after an attempt's first step; the run is held at a boundary until it is ready, so
    # the kill below surely finds it, and again after the restart until the pool is refilled (on a loaded
    # machine the imports take seconds).
    first = _hold_until_standby_ready(job)
    for point in job.metrics(timeout=120):
        if point.kind == "train" and point.step >= first + 2:  # past a commit (period 2)
            break
    ray.kill(ray.get_actor(rank_name("standby", 1), namespace=NAMESPACE))
    for point in job.metrics(timeout=120):
        if point.rank == -1 and "world_size" in point.values:  # the restart's attempt began
            break
    _hold_until_standby_ready(job)
    summary = job.result(timeout=180)

    assert summary.status == "finished", summary.error
    assert summary.restarts == 1 and summary.standby_ranks_used == [0, 1]
    assert [summary.losses[s] for s in range(1, STEPS + 1)] == reference
    assert sorted(trained_samples(tmp_path)) == list(range(1, STEPS + 1))

    pids = _attempt_pids(tmp_path, world=2)
    standby_pid = summary.standby_pids[0]
    assert standby_pid in pids[1].values()  # one restarted rank is the standby's process ...
    assert not set(pids[0].values()) & set(pids[1].values())  # ... and every failed rank was killed
    refill = summary.standby_pids[1:]  # the pool refilled after the restart's first step
    assert len(refill) == 1 and refill[0] not in pids[0].values() and refill[0] not in pids[1].values()

    on_disk = json.loads((tmp_path / "run_summary.json").read_text())
    (phases,) = on_disk["recovery_phases_s"]
    (recovery,) = on_disk["recovery_times_s"]
    assert set(phases) == {DETECT, *PHASES}
    assert all(v >= 0 for v in phases.values()), phases
    assert sum(phases[p] for p in PHASES) == pytest.approx(recovery, abs=0.05), phases
    # The ranks' own setup points arrived: `start` ends only at a rank's mark (it would be 0 without any),
    # rank 0's marks split its setup, and the step's 0.3 s sleep lies after its first boundary.
    assert phases["start"] > 0, phases
    assert phases["init_process_group"] + phases["build"] + phases["load"] > 0, phases
    assert phases["first_step"] >= 0.3, phases


def test_phase_split_sums_to_the_recovery_and_absorbs_clock_skew() -> None:
    ends: list[float | None] = [100.0, 100.5, 101.0, 101.2, None, 101.1, 102.0, 103.0, 104.0]
    phases = split(100.0, ends, detect_s=0.3)
    assert phases[DETECT] == 0.3
    assert phases["start"] == 0.0  # not seen: its time goes to the next known phase
    assert phases["init_process_group"] == 0.0  # ended "before" place (another clock): 0, not negative
    assert phases["build"] == pytest.approx(102.0 - 101.2)
    assert sum(phases[p] for p in PHASES) == pytest.approx(4.0)


def test_setup_point_gives_back_the_rank_timestamps() -> None:
    values = {SETUP_PROCESS_GROUP: 0.5, SETUP_BUILD: 1.25, SETUP_LOAD: 0.25}
    marks = setup_marks(MetricPoint(4, 0, values, "health", wall_time=1002.0))
    assert marks == (1000.0, 1000.5, 1001.75, 1002.0)
    assert setup_marks(MetricPoint(4, 1, {SETUP_PROCESS_GROUP: 0.5, SETUP_BUILD: 1.0}, "health", 10.0)) == (
        8.5,
        9.0,
        10.0,
        None,
    )
    assert setup_marks(MetricPoint(4, 0, {"loss": 1.0}, "train", 10.0)) is None


def test_clearing_uncommitted_steps_waits_for_a_commit_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm restart clears uncommitted steps within milliseconds of the failure, while the failed
    attempt's commit may still be running in its thread: the clear must not delete the files under it."""
    data = b"shard" * 10
    step_dir = tmp_path / step_dir_name(4)
    step_dir.mkdir()
    (step_dir / "shard.pt").write_bytes(data)
    report = RankCheckpointReport(
        4, 0, step_dir, (CheckpointFile("shard.pt", len(data), hashlib.sha256(data).hexdigest()),)
    )
    store = checkpoints.CheckpointStore(tmp_path, keep_last=2)
    entered, release = threading.Event(), threading.Event()
    real_commit = checkpoints.commit

    def held_commit(*args: Any, **kwargs: Any) -> Path:
        entered.set()
        release.wait(30)
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "commit", held_commit)
    outcome: list[object] = []

    def run_commit() -> None:
        try:
            outcome.append(store.commit(4, [report], 1))
        except Exception as e:
            outcome.append(e)

    committing = threading.Thread(target=run_commit)
    committing.start()
    assert entered.wait(30)
    clearing = threading.Thread(target=store.clear_uncommitted)
    clearing.start()
    clearing.join(0.3)  # without the lock the clear is done by now, deleting the step under the commit
    release.set()
    committing.join(30)
    clearing.join(30)

    assert outcome == [step_dir]
    latest = store.latest()
    assert latest is not None and latest.step == 4 and (step_dir / "shard.pt").read_bytes() == data
