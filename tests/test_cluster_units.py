"""Cluster-layer logic that needs no Ray instance: config, world planning, placement, state, commits."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from d9d.cluster.checkpoints import CheckpointStore
from d9d.cluster.config import RankResources
from d9d.cluster.elastic import valid_plans
from d9d.cluster.placement import (
    assign_bundles,
    device_placement,
    free_capacity,
    local_ranks,
    node_capacity,
)
from d9d.cluster.rank import RankNode
from d9d.cluster.sink import ReplayFilter
from d9d.cluster.spec import build_job, load_job
from d9d.cluster.state import IllegalTransition, JobState, RunSummary, StateMachine
from d9d.core import DeviceMeshParameters
from d9d.engine.checkpoint import CheckpointError, read_latest, step_dir_name
from d9d.engine.config import BatchingConfig, ConfigError
from d9d.engine.runtime import CheckpointFile, MetricPoint, RankCheckpointReport
from d9d.engine.tracking_sink import metric_names
from tests.cluster_fixtures import toy_job

pytestmark = pytest.mark.timeout(60)


# -- config -------------------------------------------------------------------------------------------------


def test_job_resolves_paths_and_defaults(tmp_path: Path) -> None:
    spec = build_job(toy_job("units", tmp_path / "run"))
    assert spec.run_dir == (tmp_path / "run").resolve()
    assert spec.checkpoint_dir == (tmp_path / "run" / "checkpoints").resolve()
    assert (spec.initial_workers, spec.min_workers, spec.max_workers, spec.elastic) == (2, 2, 2, False)
    assert spec.step_timeout_s == 30 and spec.init_timeout_s == 60
    assert spec.rank_config(1)["checkpointing"]["dir"] == str(spec.checkpoint_dir)


def test_job_resolves_the_export_dir_where_the_driver_runs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    job = toy_job("units", tmp_path / "run")
    job["checkpointing"] = {**job.get("checkpointing", {}), "export_hf_dir": "exported"}
    spec = build_job(job)
    assert spec.rank_config(0)["checkpointing"]["export_hf_dir"] == str(tmp_path.resolve() / "exported")


def test_coordinator_storage_gives_each_rank_its_own_scratch(tmp_path: Path) -> None:
    job = toy_job(
        "units", tmp_path / "run", cluster={"storage": {"kind": "coordinator", "local_dir": str(tmp_path)}}
    )
    spec = build_job(job)
    dirs = {spec.rank_config(r)["checkpointing"]["dir"] for r in range(2)}
    assert dirs == {str(tmp_path / "units" / "rank-00000"), str(tmp_path / "units" / "rank-00001")}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["cluster"].update(bogus=1), "cluster.bogus"),
        (lambda d: d["cluster"].update(min_workers=4, max_workers=2), "min_workers=4 is larger"),
        (lambda d: d["mesh"].update(expert_parallel=3), "expert_parallel=3 must divide"),
        (lambda d: d.update(unknown_section={}), "unknown_section"),
        (lambda d: d["cluster"].update(num_workers=3), "cluster.num_workers: cannot run on 3 ranks"),
        (lambda d: d["batching"].update(global_batch_size=7), "not divisible"),
        (lambda d: d["cluster"].update(entrypoint="no-colon"), "cluster.entrypoint"),
        (lambda d: d["logging"].update(tracker={"kind": "aim"}), "logging.tracker"),
    ],
)
def test_config_errors_name_the_field(tmp_path: Path, mutate, message: str) -> None:
    job = toy_job("units", tmp_path / "run")
    mutate(job)
    with pytest.raises(ConfigError, match=message):
        build_job(job)


def test_load_job_applies_overrides_to_both_parts(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(toy_job("units", tmp_path / "run")))
    spec = load_job(path, ["trainer.total_steps=5", "cluster.max_failures=7"], num_workers=4, cpu=True)
    assert spec.train.trainer.total_steps == 5
    assert spec.cluster.max_failures == 7
    assert spec.initial_workers == 4 and spec.cluster.resources.gpus == 0


# -- elastic plans ----------------------------------------------------------------------------------------


def test_valid_plans_keep_replica_shape_and_global_batch() -> None:
    mesh = DeviceMeshParameters(pipeline_parallel=2, data_parallel_shard=4, expert_parallel=2)
    batching = BatchingConfig(global_batch_size=24, microbatch_size=2)
    plans = valid_plans(mesh, batching, 2, 8)
    # replicas are pp=2 ranks; dp must keep ep=2 dividing it and 24 = dp * 2 * accumulation
    assert [(p.world_size, p.data_parallel, p.gradient_accumulation) for p in plans] == [(8, 4, 3), (4, 2, 6)]
    for p in plans:
        assert p.mesh.pipeline_parallel == 2 and p.mesh.expert_parallel == 2
        assert p.mesh.world_size == p.world_size
        assert p.data_parallel * batching.microbatch_size * p.gradient_accumulation == 24


# -- placement --------------------------------------------------------------------------------------------


def test_assign_bundles_gives_nodes_consecutive_rank_blocks() -> None:
    bundle_nodes = ["b", "a", "b", "a", "a", "c"]
    order = assign_bundles(bundle_nodes)
    assert sorted(order) == list(range(6))
    rank_nodes = [bundle_nodes[b] for b in order]
    assert rank_nodes == ["a", "a", "a", "b", "b", "c"]  # largest block first, then Ray's order
    assert local_ranks(rank_nodes) == [(0, 3), (1, 3), (2, 3), (0, 2), (1, 2), (0, 1)]


def test_capacity_counts_each_node_separately() -> None:
    nodes = [
        {"Alive": True, "Resources": {"CPU": 3.0, "GPU": 2.0}},
        {"Alive": True, "Resources": {"CPU": 1.0}},
        {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},
    ]
    assert node_capacity(nodes, RankResources(cpus=2)) == 1  # 3//2 + 1//2; dead node ignored
    assert node_capacity(nodes, RankResources(cpus=1, gpus=1)) == 2
    assert free_capacity({"CPU": 5.0, "GPU": 1.0}, RankResources(cpus=2, gpus=1)) == 1


def test_gpu_ranks_see_their_node_gpus_and_drive_their_own() -> None:
    nodes = [
        RankNode("n1", "10.0.0.1", ("3",)),
        RankNode("n1", "10.0.0.1", ("1",)),
        RankNode("n2", "10.0.0.2", ("0",)),
    ]
    assert device_placement(nodes, gpus=True) == [(1, 2, "1,3"), (0, 2, "1,3"), (0, 1, "0")]
    assert device_placement(nodes, gpus=False) == [(0, 2, None), (1, 2, None), (0, 1, None)]


# -- state ------------------------------------------------------------------------------------------------


def test_state_machine_allows_only_listed_transitions() -> None:
    m = StateMachine()
    for s in (JobState.STARTING, JobState.RUNNING, JobState.PAUSED, JobState.RESTARTING, JobState.STARTING):
        m.to(s)
    m.to(JobState.FINISHED)
    assert m.state.terminal
    with pytest.raises(IllegalTransition, match="from finished to running"):
        m.to(JobState.RUNNING)
    with pytest.raises(IllegalTransition, match="from pending to paused"):
        StateMachine().to(JobState.PAUSED)


def test_summary_json_round_trip() -> None:
    s = RunSummary("r", "finished", 3, 1, [0.5], 0.25, 10.0, losses={1: 1.0, 3: 0.25})
    assert RunSummary.from_json(s.to_json()) == s


def test_metric_names() -> None:
    assert metric_names(MetricPoint(1, 0, {"loss": 2.0})) == {"train/loss": 2.0}
    assert metric_names(MetricPoint(1, 3, {"step_time_s": 1.0}, "health")) == {
        "system/rank3/step_time_s": 1.0
    }
    assert metric_names(MetricPoint(1, -1, {"recovery_time_s": 4.0}, "health")) == {
        "system/cluster/recovery_time_s": 4.0
    }
    assert metric_names(MetricPoint(1, 0, {"eval/ppl": 9.0}, "eval")) == {"eval/ppl": 9.0}
    assert metric_names(MetricPoint(1, 0, {"ppl": 9.0}, "eval")) == {"eval/ppl": 9.0}


def test_replay_filter_drops_recomputed_steps_but_not_late_streams() -> None:
    f = ReplayFilter()
    loss = [MetricPoint(s, 0, {"loss": 1.0, "lr": 0.1}) for s in (1, 2, 3)]
    assert [f.fresh(p) for p in loss] == [True, True, True]
    # a background collector finishes step 2's task metrics after step 3's loss: a stream of its own
    assert f.fresh(MetricPoint(2, 0, {"task/accuracy": 0.5}))
    assert f.fresh(MetricPoint(3, 1, {"step_time_s": 0.1}, "health"))
    # after a restart from the checkpoint of step 1, steps 2-3 come again and are not written twice
    assert not f.fresh(MetricPoint(2, 0, {"loss": 1.0, "lr": 0.1}))
    assert not f.fresh(MetricPoint(2, 0, {"task/accuracy": 0.5}))
    assert not f.fresh(MetricPoint(3, 1, {"step_time_s": 0.1}, "health"))
    assert f.fresh(MetricPoint(4, 0, {"loss": 1.0, "lr": 0.1}))


# -- commit protocol --------------------------------------------------------------------------------------


def _write_rank(root: Path, step: int, rank: int, payload: bytes) -> RankCheckpointReport:
    step_dir = root / step_dir_name(step)
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / f"r{rank}.bin").write_bytes(payload)
    f = CheckpointFile(f"r{rank}.bin", len(payload), hashlib.sha256(payload).hexdigest())
    return RankCheckpointReport(step, rank, step_dir, (f,))


def test_commit_requires_every_rank_and_intact_files(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    first = [_write_rank(tmp_path, 2, r, b"step2-%d" % r) for r in range(2)]
    store.commit(2, first, world_size=2)
    assert read_latest(tmp_path) == tmp_path / step_dir_name(2)

    second = [_write_rank(tmp_path, 4, r, b"step4-%d" % r) for r in range(2)]
    with pytest.raises(CheckpointError, match=r"no checkpoint report from rank\(s\) \[1\]"):
        store.commit(4, second[:1], world_size=2)
    # Same size, other bytes, arriving through the coordinator (hashed on arrival; a file changed on shared
    # storage after its rank hashed it is caught by the manifest check at resume instead).
    store.write_chunk(4, "r1.bin", 0, b"step4-X")
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        store.commit(4, second, world_size=2)
    (tmp_path / step_dir_name(4) / "r1.bin").write_bytes(b"short")
    with pytest.raises(CheckpointError, match="missing or not 7 bytes"):
        store.commit(4, second, world_size=2)
    latest = store.latest()
    assert latest is not None and latest.step == 2
    assert [f.relative_path for f in latest.files] == ["r0.bin", "r1.bin"]

    store.clear_uncommitted()
    assert not (tmp_path / step_dir_name(4)).exists()
    assert (tmp_path / step_dir_name(2)).exists()


def test_chunked_transfer_round_trip(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=1)
    data = bytes(range(256)) * 5
    for offset in range(0, len(data), 300):
        store.write_chunk(3, "sub/file.bin", offset, data[offset : offset + 300])
    assert (tmp_path / step_dir_name(3) / "sub" / "file.bin").read_bytes() == data
    assert store.read_chunk(3, "sub/file.bin", 600, 300) == data[600:900]
    with pytest.raises(CheckpointError, match="escapes"):
        store.write_chunk(3, "../../evil", 0, b"x")


def test_connect_tries_a_ray_client_start_race_once_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's Ray client proxier can fail to start a client's server when a process it inspects exits
    meanwhile; `connect` tries once more. Any other refusal is raised at once."""
    import d9d.cluster.client as client

    calls: list[str] = []

    def init(address: str, runtime_env: object = None) -> None:
        calls.append(address)
        if len(calls) == 1:
            raise ConnectionAbortedError("Initialization failure from server:\nNoSuchProcess")

    monkeypatch.setattr(client.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(client.ray, "init", init)
    monkeypatch.setattr(client.time, "sleep", lambda _s: None)
    client.connect("ray://head:10001")
    assert calls == ["ray://head:10001"] * 2

    def refuse(address: str, runtime_env: object = None) -> None:
        calls.append(address)
        raise ConnectionAbortedError("authentication failed")

    calls.clear()
    monkeypatch.setattr(client.ray, "init", refuse)
    with pytest.raises(ConnectionAbortedError, match="authentication"):
        client.connect("ray://head:10001")
    assert len(calls) == 1


def test_startup_phases_follow_their_marks() -> None:
    from d9d.cluster.control.startup import StartupClock, describe

    clock = StartupClock(started=100.0)
    assert clock.current() == ("ray", 100.0)  # `launch` is the driver's, and optional (a notebook)
    clock.end("launch", 103.0)
    clock.end("ray", 106.5)
    clock.end("launch", 999.0)  # the first mark of a phase counts
    assert clock.phases() == {"launch": 3.0, "ray": 3.5}
    assert clock.current() == ("coordinator", 106.5)
    clock.end("coordinator", 108.0)
    clock.end("place", 107.5)  # a clock behind the previous one's: 0, never negative
    clock.end("actors", 116.0)
    assert clock.current() == ("process_group", 116.0)  # the tracker is optional: it may be ready already
    for phase, at in (("process_group", 116.5), ("build", 117.0), ("load", 117.25), ("first_step", 118.0)):
        clock.end(phase, at)
    phases = clock.phases()
    assert phases["place"] == 0.0 and phases["actors"] == 8.0 and "tracker" not in phases
    assert sum(phases.values()) == 18.0 and clock.done and clock.current() is None
    assert describe(phases).startswith(
        "18.0s: launch 3.0s, ray 3.5s, coordinator 1.5s, place 0.0s, actors 8.0s"
    )


# -- the rank's reporter -------------------------------------------------------------------------------


class _Call:
    """A call to the fake coordinator: it runs when someone waits for it (`ray.get`) or at `deliver_all`, so
    the test decides the order in which the coordinator sees a rank's calls, as an asynchronous actor may."""

    def __init__(self, coordinator: _OutOfOrderCoordinator, method: str, args: tuple) -> None:
        self.coordinator, self.method, self.args, self.ran = coordinator, method, args, False

    def run(self) -> None:
        if not self.ran:
            self.ran = True
            self.coordinator.execute(self.method, self.args)


class _Method:
    def __init__(self, coordinator: _OutOfOrderCoordinator, name: str) -> None:
        self.coordinator, self.name = coordinator, name

    def remote(self, *args: object) -> _Call:
        call = _Call(self.coordinator, self.name, args)
        self.coordinator.calls.append(call)
        return call


class _OutOfOrderCoordinator:
    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.losses: dict[int, float] = {}
        self.losses_at_commit: dict[int, dict[int, float]] = {}

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)

    def execute(self, method: str, args: tuple) -> None:
        points: list[MetricPoint] = []
        match method:
            case "boundary":
                points = args[2]
            case "report":
                points = args[1]
            case "commit":
                points = args[3] if len(args) > 3 else []
        self.losses |= {p.step: p.values["loss"] for p in points if "loss" in p.values}
        if method == "commit":
            self.losses_at_commit[args[1]] = dict(self.losses)


def test_a_committed_steps_loss_reaches_the_coordinator_before_the_commit(monkeypatch) -> None:
    """A restart resumes after the committed step and never reports its loss again; a resize tears the
    attempt down right after a commit. So the commit must not be seen before the step's loss, whether the
    loss is still queued or in a courier call the (asynchronous) coordinator has not run yet."""
    from d9d.cluster import reporter as reporter_module

    monkeypatch.setattr(reporter_module.ray, "get", lambda call: call.run())
    coordinator = _OutOfOrderCoordinator()
    rank0 = reporter_module.RayRunReporter(coordinator, attempt=1, rank=0, command_seq=0, transfer=None)

    def loss(step: int) -> MetricPoint:
        return MetricPoint(step, 0, {"loss": float(step)}, "train", 0.0)

    rank0.metrics(loss(1))
    rank0.commands(1)  # the step boundary
    rank0._send(last_step=None)  # the courier carries step 1's loss; the coordinator has not run that call
    rank0.metrics(loss(2))  # still queued at the commit
    rank0.commit_checkpoint(2, [])
    assert coordinator.losses_at_commit[2] == {1: 1.0, 2: 2.0}

    rank0.metrics(loss(3))
    rank0._send(last_step=1)
    rank0.close()  # the last points of a run, and the courier's call before them, arrive before it returns
    assert coordinator.losses == {1: 1.0, 2: 2.0, 3: 3.0}
    assert all(call.ran for call in coordinator.calls if call.method in ("boundary", "report", "commit"))
