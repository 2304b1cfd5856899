"""Resources and records: one `run_summary.json` record per launch, recovery time from the first failure of
a chain, placement groups released after a failure, a stop and a coordinator's death, a rerun in the same
driver after the coordinator died, and setup errors that are not retried."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from d9d.cluster.control.outcome import Failed, Finished, Outcome
from d9d.cluster.spec import build_job
from d9d.cluster.state import SUMMARY_FILE, JobState, RunSummary, launch_record, record_launch
from d9d.engine.runtime import RankResult, RankRuntime, RunReporter
from tests.cluster_fixtures import toy_job, wait_for_step

# -- run_summary.json ----------------------------------------------------------------------------------------


def _summary(status: str, steps: int, launch: str, **extra: Any) -> RunSummary:
    return RunSummary(run_name="r", status=status, steps=steps, restarts=0, launch_id=launch, **extra)


def test_each_launch_keeps_its_record_and_a_failed_relaunch_does_not_erase_a_finished_one(
    tmp_path: Path,
) -> None:
    finished = _summary("finished", 40, "a", losses={40: 1.5}, final_loss=1.5)
    record_launch(tmp_path, finished)
    record_launch(tmp_path, _summary("running", 0, "b"))
    record_launch(tmp_path, _summary("failed", 0, "b", error="boom"))  # the same launch: updated in place

    on_disk = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert [r["launch_id"] for r in on_disk["launches"]] == ["a", "b"]
    assert RunSummary.from_json(on_disk["launches"][0]) == finished
    # The top level is the latest launch, for readers of the one-record format.
    assert (on_disk["status"], on_disk["steps"], on_disk["error"]) == ("failed", 0, "boom")
    assert RunSummary.from_json(on_disk).launch_id == "b"
    assert launch_record(tmp_path, "a") == finished and launch_record(tmp_path, "c") is None


def test_a_summary_of_the_one_record_format_becomes_the_first_launch(tmp_path: Path) -> None:
    old = _summary("finished", 10, "")
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(old.to_json()))
    record_launch(tmp_path, _summary("failed", 0, "x"))
    launches = json.loads((tmp_path / SUMMARY_FILE).read_text())["launches"]
    assert [(r["status"], r["steps"]) for r in launches] == [("finished", 10), ("failed", 0)]


def test_an_unreadable_summary_is_moved_aside_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / SUMMARY_FILE).write_text('{"status": "finished", trunc')
    record_launch(tmp_path, _summary("failed", 0, "x"))
    aside = list(tmp_path.glob(f"{SUMMARY_FILE}.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_text() == '{"status": "finished", trunc'
    assert json.loads((tmp_path / SUMMARY_FILE).read_text())["status"] == "failed"


# -- the controller, with fake workers -----------------------------------------------------------------------


class _Workers:
    def __init__(self, spec: Any) -> None:
        from d9d.cluster.control.scaling import ScalingPolicy

        self.policy = ScalingPolicy.for_job(spec)
        self.released: list[Any] = []

    async def reserve(self, target: int) -> tuple[Any, Any]:
        return self.policy.candidates(target, target)[0], f"pg-{len(self.released)}"

    async def teardown(self, at: Any) -> None:
        self.released.append(at.pg)

    def free(self) -> int:
        return 0

    def alive(self) -> frozenset[str]:
        return frozenset({"head"})


def _controller(tmp_path: Path, runner: Any, **cluster: Any) -> tuple[Any, _Workers]:
    from d9d.cluster.checkpoints import CheckpointStore
    from d9d.cluster.control.controller import Controller
    from d9d.cluster.control.mailbox import CommandMailbox
    from d9d.cluster.control.metrics import MetricsHub
    from d9d.cluster.control.signal import Changes
    from d9d.cluster.sink import MetricsWriter

    class _Sink:
        def write(self, points: Any) -> None: ...

        def close(self, status: Any) -> None: ...

    spec = build_job(toy_job("ctl", tmp_path / "run", world=2, cluster=cluster))
    workers = _Workers(spec)
    hub = MetricsHub(MetricsWriter(_Sink, min_interval_s=0.0))
    store = CheckpointStore(spec.checkpoint_dir, 2)
    ctl = Controller(spec, store, CommandMailbox(), hub, Changes(), workers=workers, runner=runner)
    runner.ctl = ctl
    return ctl, workers


class _Runner:
    """Fails `failures` attempts, then completes step 1 and finishes."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.ctl: Any = None

    async def run(self, at: Any) -> Outcome:
        self.ctl.machine.to(JobState.RUNNING)
        if self.failures:
            self.failures -= 1
            return Failed("rank 0: died")
        self.ctl.step_seen(1)
        return Finished()


def test_recovery_time_is_measured_from_the_first_failure_of_a_chain(tmp_path: Path) -> None:
    backoff = 0.3  # restarts wait 0.3 s, then 0.6 s: a recovery from the first failure spans both
    ctl, _ = _controller(tmp_path, _Runner(failures=2), restart_backoff_s=backoff, max_backoff_s=10.0)
    state = asyncio.run(ctl.run())
    summary = ctl.finish(state)
    assert state is JobState.FINISHED and summary.failures == ["rank 0: died"] * 2
    assert len(summary.recovery_times_s) == 1
    assert summary.recovery_times_s[0] >= backoff + 2 * backoff  # not reset by the second failure


def test_placement_group_is_released_when_preparing_the_store_fails(tmp_path: Path) -> None:
    ctl, workers = _controller(tmp_path, _Runner(failures=0))

    def broken() -> int:
        raise OSError("checkpoint directory on a read-only filesystem")

    ctl._prepare_store = broken

    async def run() -> None:
        with pytest.raises(OSError, match="read-only"):
            await ctl.run()
        await ctl.teardown()  # what the coordinator does on every way out of the loop

    asyncio.run(run())
    assert workers.released == ["pg-0"]


# -- on Ray --------------------------------------------------------------------------------------------------


def _read_shard(path: Path) -> bytes:
    return path.read_bytes()


def missing_data_rank(config: dict[str, Any], runtime: RankRuntime, reporter: RunReporter) -> RankResult:
    """An entrypoint whose every rank fails during setup the way a missing dataset file does."""
    shard = Path(config["run"]["dir"]) / f"shard-{runtime.rank}.bin"
    try:
        _read_shard(shard)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"rank {runtime.rank} cannot open its data") from e
    raise AssertionError("the shard exists")


def _run_pgs(run_name: str) -> list[str]:
    from ray.util.placement_group import placement_group_table

    from d9d.cluster.placement import run_placement_groups

    return run_placement_groups(placement_group_table(), run_name)


@pytest.mark.ray
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("_ray")
def test_setup_error_on_every_rank_fails_at_once_with_its_chain_and_no_placement_group_left(
    tmp_path: Path,
) -> None:
    from d9d.cluster import TrainingJob

    job = toy_job("setup", tmp_path)
    job["cluster"] = {**job["cluster"], "entrypoint": "tests.test_trust_records:missing_data_rank"}
    summary = TrainingJob(build_job(job)).start().result(timeout=150)

    assert summary.status == "failed" and summary.restarts == 0 and len(summary.failures) == 1
    assert summary.error is not None and summary.error.startswith("not retryable: rank ")
    assert "shard-" in summary.error and "test_trust_records.py" in summary.error  # the whole chain
    assert "direct cause" in summary.error
    assert _run_pgs("setup") == []


@pytest.mark.ray
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_ray")
def test_coordinator_death_is_recorded_frees_the_run_and_a_rerun_in_the_same_driver_works(
    tmp_path: Path,
) -> None:
    import ray

    from d9d.cluster import TrainingJob
    from d9d.cluster.names import NAMESPACE, coordinator_name

    job = toy_job("lost", tmp_path, steps=200, model={"options": {"step_sleep_s": 0.1}})
    job["logging"] = {"tracker": {"kind": "log", "stdout": False}}  # metrics.jsonl records how runs end
    first = TrainingJob(build_job(job)).start()
    wait_for_step(first, 2)
    assert _run_pgs("lost") != []
    started = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert [r["status"] for r in started["launches"]] == ["starting"]  # a launch is on record from its start
    ray.kill(ray.get_actor(coordinator_name("lost"), namespace=NAMESPACE), no_restart=True)

    lost = first.result(timeout=60)
    assert lost.status == "failed" and lost.error is not None and lost.error.startswith("coordinator lost")
    assert first.status().state is JobState.FAILED
    assert _run_pgs("lost") == []  # the dead coordinator's group belonged to this driver's job
    on_disk = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert on_disk["status"] == "failed" and on_disk["error"].startswith("coordinator lost")

    second = TrainingJob(build_job(job)).start()  # same name, same driver
    wait_for_step(second, 2)
    second.stop(force=True)  # what `d9d stop` makes `d9d train` do (SIGTERM)
    stopped = second.result(timeout=120)
    assert stopped.status == "stopped" and stopped.steps >= 2
    assert _run_pgs("lost") == []
    on_disk = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert [r["status"] for r in on_disk["launches"]] == ["failed", "stopped"]
    assert on_disk["status"] == "stopped" and on_disk["launches"][0]["error"].startswith("coordinator lost")
    # The tracker run is ended as killed (MLflow: KILLED); the lost launch never closed it.
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["status"] for e in events if e.get("event") == "close"] == ["killed"]
