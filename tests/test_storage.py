"""A run's durable storage (`run.storage`): a local path or an fsspec URI, with the checkpoint commit protocol
held on an object store (no rename), proven end to end against an S3 server started on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.cli.main import main
from d9d.cluster.reach import SUBMITTED_PATHS_ENV, check_submitted_paths, pin_relative_paths
from d9d.cluster.spec import build_job
from d9d.cluster.state import RunSummary, launch_record, record_launch
from d9d.core.storage import StorageError, StoragePath, location, move_tree, remove_tree, write_file
from d9d.engine.checkpoint import (
    LATEST,
    MANIFEST,
    CheckpointError,
    LocalRunReporter,
    commit,
    quarantine,
    select_commit,
)
from d9d.engine.checkpoint_io import hashed_bytes
from d9d.engine.config import ConfigError, parse_config
from d9d.engine.launch import run_rank
from d9d.engine.resume import check_resume
from d9d.engine.runtime import CheckpointFile, MetricPoint, RankCheckpointReport, RankRuntime
from tests.harness import DistributedTestFailure, RankEnv, run_distributed

BUCKET = "d9d-test"


def memory_root(name: str) -> StoragePath:
    root = location(f"memory://{name}")
    assert isinstance(root, StoragePath)
    remove_tree(root)
    return root


# -- the storage layer -------------------------------------------------------------------------------------


def test_location_is_a_path_for_local_and_file_uris_and_a_storage_path_for_a_protocol(tmp_path: Path) -> None:
    assert location(tmp_path) == tmp_path
    assert location(f"file://{tmp_path}") == tmp_path
    assert location("runs/x") == Path("runs/x")
    root = location("memory://bucket/runs")
    assert isinstance(root, StoragePath)
    step = root / "r" / "step-00000001"
    assert str(step) == "memory://bucket/runs/r/step-00000001"
    assert step.name == "step-00000001" and step.parent == root / "r"
    with pytest.raises(StorageError, match="nope://"):
        location("nope://x")


def test_run_storage_names_the_key_for_an_unknown_protocol(tmp_path: Path) -> None:
    raw = _config("s", tmp_path / "run", 2)
    raw["run"]["storage"] = "nope://bucket/runs"
    with pytest.raises(ConfigError, match=r"run\.storage"):
        parse_config(raw)
    raw["run"]["storage"] = str(tmp_path / "store")  # a plain path: an NFS mount, say
    config = parse_config(raw)
    assert config.checkpoint_dir == tmp_path / "store" / "s" / "checkpoints"
    assert config.run_dir == tmp_path / "run"  # logs and traces stay in run.dir


def test_storage_path_files_listing_moves_and_removal() -> None:
    root = memory_root("ops")
    write_file(root / "a" / "x.bin", b"12345")
    write_file(root / "a" / "y.txt", b"hello")
    write_file(root / "b" / "z", b"")
    assert [p.name for p in root.iterdir()] == ["a", "b"]
    assert [p.name for p in (root / "a").glob("*.bin")] == ["x.bin"]
    assert (root / "a").is_dir() and (root / "a" / "x.bin").is_file() and not (root / "a").is_file()
    assert (root / "a" / "x.bin").stat().st_size == 5
    assert (root / "a" / "y.txt").read_text() == "hello"
    write_file(root / "a" / "y.txt", b"replaced")
    assert (root / "a" / "y.txt").read_bytes() == b"replaced"
    move_tree(root / "a", root / "moved" / "a")
    assert not (root / "a").exists()
    assert sorted(p.name for p in (root / "moved" / "a").iterdir()) == ["x.bin", "y.txt"]
    remove_tree(root / "moved")
    remove_tree(root / "never-there")
    assert [p.name for p in root.iterdir()] == ["b"]


def _report(root: StoragePath, step: int, rank: int, files: dict[str, bytes]) -> RankCheckpointReport:
    step_dir = root / f"step-{step:08d}"
    written = []
    for name, data in files.items():
        write_file(step_dir / name, data)
        h = hashed_bytes(data)
        written.append(CheckpointFile(name, h.size, h.sha256))
    return RankCheckpointReport(step=step, rank=rank, step_dir=step_dir, files=tuple(written))


def test_commit_on_an_object_store_writes_manifest_then_latest_only_after_every_file_checks() -> None:
    root = memory_root("commit")
    good = [_report(root, 5, r, {f"rank-{r}.pt": bytes([r]) * 10}) for r in range(2)]
    commit(root, 5, good, keep_last=3)
    assert (root / LATEST).read_text() == "step-00000005"
    assert set(json.loads((root / "step-00000005" / MANIFEST).read_text())["files"]) == {
        "rank-0.pt",
        "rank-1.pt",
    }

    # A rank reports a file that never arrived: no manifest, `latest` still names the previous commit.
    report = _report(root, 10, 0, {"rank-0.pt": b"x" * 10})
    missing = RankCheckpointReport(10, 1, report.step_dir, (CheckpointFile("rank-1.pt", 10, "0" * 64),))
    with pytest.raises(CheckpointError, match=r"rank-1\.pt is missing"):
        commit(root, 10, [report, missing], keep_last=3)
    assert not (root / "step-00000010" / MANIFEST).exists()
    assert (root / LATEST).read_text() == "step-00000005"
    assert select_commit(root).step == 5

    # Damage the newest commit: the previous one is chosen, the damaged one moved aside (copy + delete).
    commit(root, 10, [_report(root, 10, 0, {"rank-0.pt": b"y" * 10})], keep_last=3)
    write_file(root / "step-00000010" / "rank-0.pt", b"z" * 10)
    selection = select_commit(root)
    assert selection.step == 5 and [p.name for p, _ in selection.skipped] == ["step-00000010"]
    moved = quarantine(selection.skipped[0][0])
    assert moved.parent.name == "damaged" and (moved / "rank-0.pt").read_bytes() == b"z" * 10
    assert not (root / "step-00000010").exists()


def test_run_summary_lives_in_the_storage_root() -> None:
    root = memory_root("summary") / "run"
    record_launch(root, RunSummary("run", "finished", steps=3, restarts=0, launch_id="L1"))
    record_launch(root, RunSummary("run", "failed", steps=0, restarts=1, launch_id="L2"))
    recorded = launch_record(root, "L1")
    assert recorded is not None and recorded.steps == 3 and recorded.status == "finished"
    data = json.loads((root / "run_summary.json").read_text())
    assert data["launch_id"] == "L2" and [r["launch_id"] for r in data["launches"]] == ["L1", "L2"]


def test_an_object_store_root_excludes_coordinator_storage(tmp_path: Path) -> None:
    job = {
        **_config("c", tmp_path / "run", 2, {"uri": "memory://runs"}),
        "cluster": {"storage": {"kind": "coordinator"}},
    }
    with pytest.raises(ConfigError, match=r"run\.storage memory://runs/c is an object store"):
        build_job(job, cpu=True)
    job["cluster"] = {}
    spec = build_job(job, cpu=True)
    assert str(spec.checkpoint_dir) == "memory://runs/c/checkpoints" and spec.run_dir == tmp_path / "run"


# -- d9d submit: relative local paths -----------------------------------------------------------------------


def test_submit_resolves_relative_paths_here_and_the_cluster_refuses_what_it_cannot_see(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    raw = _config("sub", None, 2)
    raw["run"].pop("dir")
    raw["run"]["storage"] = "store"
    spec = build_job(json.loads(json.dumps(raw)), cpu=True)
    pinned = pin_relative_paths(raw, spec)
    assert pinned.overrides == [f"run.dir={tmp_path / 'runs' / 'sub'}", f"run.storage={tmp_path / 'store'}"]
    assert spec.checkpoint_dir == tmp_path / "store" / "sub" / "checkpoints"

    monkeypatch.setenv(SUBMITTED_PATHS_ENV, pinned.env[SUBMITTED_PATHS_ENV])
    check_submitted_paths()  # the same machine sees its markers
    (tmp_path / "store" / ".d9d-submitted").unlink()  # as on a cluster node without the mount
    with pytest.raises(ConfigError, match=rf"run\.storage was relative .* to {tmp_path / 'store'}"):
        check_submitted_paths()


# -- end to end on S3 ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """An S3-compatible server on loopback, and the fsspec options that reach it with dummy credentials."""
    moto_server = pytest.importorskip("moto.server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "testing",
        "secret": "testing",
    }
    root = location(f"s3://{BUCKET}", options)
    assert isinstance(root, StoragePath)
    # moto keeps its buckets per process: another module's server (tests/test_storage_files.py shares this
    # fixture) may have made it already.
    with contextlib.suppress(FileExistsError):
        root.storage.fs.mkdir(BUCKET)
    try:
        yield options
    finally:
        server.stop()


def _config(name: str, run_dir: Path | None, total_steps: int, storage: dict[str, Any] | None = None) -> Any:
    run: dict[str, Any] = {"name": name, "dir": str(run_dir)}
    if storage is not None:
        run["storage"] = storage
    return {
        "run": run,
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": total_steps},
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider"},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "tests.engine_fixtures:TokenCETask"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-2}},
        "checkpointing": {"period": 4, "keep_last": 2},
        "logging": {"progress_bar": "off"},
    }


class _DiesWhileSaving(LocalRunReporter):
    """The process dies after writing step `die_at`'s files, before its commit (no cleanup, no flush).
    Records the steps this process trained."""

    die_at = 0
    trained: list[int]

    def metrics(self, point: MetricPoint) -> None:
        if point.kind == "train":
            self.trained.append(point.step)

    def checkpoint_written(self, report: RankCheckpointReport) -> None:
        if report.step == self.die_at:
            os._exit(17)


def train(env: RankEnv, raw: dict[str, Any], out: str, die_at: int = 0) -> None:
    config = parse_config(raw)
    runtime = RankRuntime(
        rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=config.run_dir
    )
    reporter = _DiesWhileSaving(config.checkpoint_dir, config.checkpointing.keep_last)
    reporter.die_at = die_at
    reporter.trained = []
    result = run_rank(config, runtime, reporter)
    torch.save(
        {"steps": result.steps, "losses": list(result.losses), "trained": sorted(set(reporter.trained))},
        env.tmp_dir / out,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Per-step losses of an uninterrupted 12-step run on a local disk."""
    base = tmp_path_factory.mktemp("reference")
    run_distributed(train, 1, _config("ref", base / "ref", 12), "ref.pt", tmp_dir=base)
    losses: list[float] = torch.load(base / "ref.pt")["losses"]
    assert len(losses) == 12
    return losses


def test_save_commit_kill_and_resume_from_s3_match_an_uninterrupted_run(
    s3: dict[str, Any], reference: list[float], tmp_path: Path
) -> None:
    storage = {"uri": f"s3://{BUCKET}/runs", "options": s3}
    raw = _config("s3run", tmp_path / "local", 12, storage)
    # Commits at steps 4 and 8 reach S3; the process dies with step 12 written but not committed.
    with pytest.raises(DistributedTestFailure):
        run_distributed(train, 1, raw, "killed.pt", 12, tmp_dir=tmp_path)
    root = parse_config(raw).checkpoint_dir
    assert isinstance(root, StoragePath) and str(root) == f"s3://{BUCKET}/runs/s3run/checkpoints"
    assert (root / LATEST).read_text() == "step-00000008"
    assert (root / "step-00000012").is_dir() and not (root / "step-00000012" / MANIFEST).exists()
    assert not (tmp_path / "local" / "checkpoints").exists()  # nothing durable went to the local run.dir

    decision = check_resume(parse_config(raw))
    assert decision.action == "resume" and decision.step == 8 and decision.step_dir == root / "step-00000008"

    # A new process resumes from the S3 commit: steps 9..12 are the uninterrupted run's, bit for bit.
    run_distributed(train, 1, raw, "resumed.pt", tmp_dir=tmp_path)
    resumed = torch.load(tmp_path / "resumed.pt")
    assert resumed["steps"] == 12 and resumed["trained"] == [9, 10, 11, 12]
    assert resumed["losses"] == reference  # steps 1..8 restored from the commit, 9..12 trained again
    assert (root / LATEST).read_text() == "step-00000012"
    manifest = json.loads((root / "step-00000012" / MANIFEST).read_text())
    assert manifest["step"] == 12 and ".metadata" in manifest["files"]
    assert [p.name for p in root.glob("step-*")] == ["step-00000008", "step-00000012"]  # keep_last=2

    # A missing or garbled `latest` object is a hint, as on a local disk: the newest verified commit wins.
    (root / LATEST).unlink()
    decision = check_resume(parse_config(raw))
    assert decision.step == 12 and any("latest is missing" in w for w in decision.warnings)
    write_file(root / LATEST, b"step-00000099")
    decision = check_resume(parse_config(raw))
    assert decision.step == 12 and any("not a committed step directory" in w for w in decision.warnings)

    # A damaged commit on S3 is passed over and moved aside whole (copy and delete: no rename there).
    step12 = root / "step-00000012"
    names = sorted(p.name for p in step12.iterdir())
    write_file(step12 / "engine.pt", b"garbage")
    selection = select_commit(root)
    assert selection.step == 8 and [p for p, _ in selection.skipped] == [step12]
    moved = quarantine(step12)
    assert not step12.exists() and sorted(p.name for p in moved.iterdir()) == names
    assert (moved / "engine.pt").read_bytes() == b"garbage"


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_under_ray_the_coordinator_commits_to_s3_and_a_killed_rank_resumes_from_there(
    s3: dict[str, Any], reference: list[float], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ray = pytest.importorskip("ray")
    from d9d.cluster import TrainingJob

    storage = {"uri": f"s3://{BUCKET}/ray", "options": s3}
    job_dict = {**_config("rayrun", tmp_path / "local", 8, storage), "cluster": {"restart_backoff_s": 0.1}}
    job_dict["logging"]["tracker"] = {"kind": "null"}
    spec = build_job(job_dict, cpu=True)
    root = spec.checkpoint_dir
    assert isinstance(root, StoragePath)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        job = TrainingJob(spec).start()
        job.wait(step=5, timeout=120)
        job.kill_rank(0)  # the new rank resumes from the commit at step 4, which the coordinator made on S3
        summary = job.result(timeout=180)
    finally:
        ray.shutdown()
    assert summary.status == "finished" and summary.restarts == 1 and summary.resumed_from[-1] == 4
    assert [summary.losses[step] for step in range(1, 9)] == reference[:8]
    assert (root / LATEST).read_text() == "step-00000008"
    on_s3 = json.loads((root.parent / "run_summary.json").read_text())
    assert on_s3["status"] == "finished" and on_s3["steps"] == 8
    assert not (tmp_path / "local" / "checkpoints").exists()
    # The run registered in its storage root, and its metric history followed it there: `d9d list` on the
    # storage URI finds it with its state, step and last loss.
    record = json.loads((root.parent / "run.json").read_text())
    assert record["run_name"] == "rayrun" and record["storage_root"] == str(root.parent)
    history = (tmp_path / "local" / "history.jsonl").read_bytes()
    assert history and (root.parent / "history.jsonl").read_bytes() == history
    options = [arg for k, v in s3.items() for arg in ("--storage-option", f"{k}={v}")]
    capsys.readouterr()
    assert main(["list", "--runs-root", f"s3://{BUCKET}/ray", *options]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("rayrun "))
    assert row[1:4] == ["finished", "8", f"{summary.losses[8]:.6g}"]
