"""One live launch per run (issue 29, deliverable 3): the lease in the run directory, as plain files and
with two real launches at once."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import ray
import yaml

from d9d.cli import exit_codes
from d9d.cli.main import main
from d9d.cluster import TrainingJob, build_job
from d9d.cluster.lease import (
    LEASE_FILE,
    LOCK_FILE,
    STALE_S,
    Lease,
    LeaseHeld,
    LeaseLost,
    acquire,
    read_lease,
    release,
    renew,
)
from tests.cluster_fixtures import toy_job


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid  # reaped: no process has it (pids are not reused that fast)


def _write(run_dir: Path, **fields: object) -> None:
    now = time.time()
    lease = {
        "run_name": "r",
        "launch_id": "old",
        "owner": "coordinator",
        "host": os.uname().nodename,
        "pid": os.getpid(),
        "ray_address": "10.0.0.1:6379",
        "acquired_at": now,
        "renewed_at": now,
        **fields,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LEASE_FILE).write_text(json.dumps(lease))


def test_a_live_lease_is_refused_naming_its_launch_and_a_dead_ones_is_taken_over(tmp_path: Path) -> None:
    _write(tmp_path)  # fresh, and its owner (this process) lives
    with pytest.raises(
        LeaseHeld,
        match=r"run r is already running: launch old \(coordinator pid \d+ on .* in "
        r"the Ray cluster at 10\.0\.0\.1:6379",
    ):
        acquire(tmp_path, "r", "new")
    # The Ray cluster this launch joined says its coordinator is gone (the head restarted, say).
    assert acquire(tmp_path, "r", "new", coordinator_running=lambda lease: False).launch_id == "new"
    release(tmp_path, "new")
    assert read_lease(tmp_path) is None

    for stale in (
        {"renewed_at": time.time() - STALE_S - 1},  # not renewed: its owner died, on any host
        {"pid": _dead_pid()},  # its owner's process on this host is gone
        {"host": "elsewhere", "renewed_at": time.time() - STALE_S - 1},
    ):
        _write(tmp_path, **stale)
        taken = acquire(tmp_path, "r", "new")
        assert taken.launch_id == "new" and taken.owner == "driver" and taken.pid == os.getpid()
        release(tmp_path, "new")
    (tmp_path / LEASE_FILE).write_text("{not json")  # damaged: nobody's
    assert acquire(tmp_path, "r", "new").launch_id == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE, LEASE_FILE]  # no stale ones left


def _race(run_dir: Path, launches: int) -> tuple[list[str], list[LeaseHeld]]:
    start = threading.Barrier(launches)
    won: list[str] = []
    refused: list[LeaseHeld] = []

    def launch(i: int) -> None:
        start.wait()
        try:
            won.append(acquire(run_dir, "r", f"launch-{i}").launch_id)
        except LeaseHeld as e:
            refused.append(e)

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(launches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, refused


def test_of_launches_racing_for_a_free_or_a_stale_lease_exactly_one_wins(tmp_path: Path) -> None:
    for stale in (False, True):
        run_dir = tmp_path / str(stale)
        if stale:
            _write(run_dir, pid=_dead_pid())
        won, refused = _race(run_dir, 8)
        assert len(won) == 1 and len(refused) == 7
        assert {e.lease.launch_id for e in refused} == set(won)
        assert read_lease(run_dir).launch_id == won[0]  # type: ignore[union-attr]


def test_a_coordinator_whose_lease_was_taken_over_loses_it(tmp_path: Path) -> None:
    mine = acquire(tmp_path, "r", "mine")
    renewed = renew(tmp_path, mine, owner="coordinator", host="h", pid=123)
    assert renewed.owner == "coordinator" and renewed.renewed_at >= mine.renewed_at
    assert read_lease(tmp_path) == renewed
    _write(tmp_path, launch_id="other")  # another launch took it over while this one was stuck
    with pytest.raises(LeaseLost, match="the lease of launch mine is now held by launch other"):
        renew(tmp_path, renewed, owner="coordinator", host="h", pid=123)
    release(tmp_path, "mine")  # not its own any more: left alone
    assert isinstance(read_lease(tmp_path), Lease) and read_lease(tmp_path).launch_id == "other"  # type: ignore[union-attr]


@pytest.mark.ray
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("_ray")
def test_two_launches_at_once_one_trains_the_other_refuses_and_a_finished_run_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = toy_job("twice", tmp_path / "run", steps=12, model={"options": {"step_sleep_s": 0.2}})
    start = threading.Barrier(2)
    started: list[TrainingJob] = []
    refused: list[LeaseHeld] = []

    def launch() -> None:
        start.wait()
        try:
            started.append(TrainingJob(build_job(job)).start())
        except LeaseHeld as e:
            refused.append(e)

    threads = [threading.Thread(target=launch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(started) == 1 and len(refused) == 1
    live = started[0]
    address = ray.get_runtime_context().gcs_address
    assert refused[0].lease.launch_id == live._launch_id and address in str(refused[0])

    live.wait(step=2, timeout=120)
    lease = read_lease(tmp_path / "run")
    coordinator_pid = ray.get(live._coordinator.journal.remote()).pid
    assert lease is not None and lease.owner == "coordinator" and lease.pid == coordinator_pid
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    assert main(["train", str(job_file)]) == exit_codes.LIVE_LAUNCH  # a launch mid-run
    err = capsys.readouterr().err
    assert f"run twice is already running: launch {live._launch_id}" in err and address in err

    summary = live.result(timeout=120)
    assert summary.status == "finished" and summary.steps == 12 and summary.restarts == 0
    deadline = time.monotonic() + 30
    while read_lease(tmp_path / "run") is not None:  # given back once the run ended
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert main(["train", str(job_file)]) == exit_codes.ALREADY_FINISHED
    assert "already finished" in capsys.readouterr().err
