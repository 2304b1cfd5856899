"""Asynchronous checkpoint saves on the real engine (`checkpointing.async`, d9d.engine.async_save): the files
and the resume are bitwise those of a synchronous save, a write that dies never becomes `latest`, and at
most one save is in flight while training goes on."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.async_save import HostStager, resolve_async
from d9d.engine.checkpoint import MANIFEST, TRAIN_CONFIG, Checkpointer, CheckpointError
from d9d.engine.checkpoint_io import METADATA, HashingWriter, read_dcp_metadata
from d9d.engine.config import parse_config
from tests.harness import DistributedTestFailure, RankEnv, run_distributed
from tests.test_checkpoint_trust import config_dict, train

pytestmark = pytest.mark.distributed

STEP5, STEP10 = "step-00000005", "step-00000010"


def _config(run_dir: Path, *, asynchronous: bool | None, ranks: int = 1, **sections: Any) -> dict[str, Any]:
    raw = config_dict(
        run_dir, mesh={"data_parallel_replicate": ranks}, batching={"microbatch_size": 2}, **sections
    )
    raw["run"]["name"] = "async"
    raw["checkpointing"]["async"] = asynchronous
    return raw


def _manifest_files(step_dir: Path) -> dict[str, Any]:
    """sha256 of every file a commit lists but the job config (it names the async setting), and the
    tensors' layout from DCP's `.metadata` (the file itself also holds a per-save id)."""
    files = json.loads((step_dir / MANIFEST).read_text())["files"]
    hashes: dict[str, Any] = {n: i["sha256"] for n, i in files.items() if n not in (TRAIN_CONFIG, METADATA)}
    hashes[METADATA] = read_dcp_metadata(step_dir / METADATA).state_dict_metadata
    return hashes


def train_recording_metrics(env: RankEnv, raw: dict[str, Any], out: str) -> None:
    """`train`, keeping this rank's checkpoint metrics with the result."""
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.launch import run_rank
    from d9d.engine.runtime import MetricPoint, RankRuntime

    config = parse_config(raw)
    metrics: list[tuple[int, str]] = []

    def sink(point: MetricPoint) -> None:
        metrics.extend((point.step, k) for k in point.values if k.startswith("checkpoint/"))

    runtime = RankRuntime(env.rank, env.world_size, env.rank, config.run_dir)
    reporter = LocalRunReporter(config.checkpoint_dir, config.checkpointing.keep_last, sink)
    result = run_rank(config, runtime, reporter)
    record = {"steps": result.steps, "losses": list(result.losses), "metrics": metrics}
    torch.save(record, env.tmp_dir / f"{out}{env.rank}.pt")


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """The reference: 10 synchronous steps on 2 data-parallel ranks, commits at steps 5 and 10."""
    base = tmp_path_factory.mktemp("sync")
    run_distributed(train, 2, _config(base / "run", asynchronous=False, ranks=2), "sync.pt", tmp_dir=base)
    return base / "run", torch.load(base / "sync.pt")["losses"]


def die_while_writing_step_10(env: RankEnv, raw: dict[str, Any]) -> None:
    """Train with async saves; the processes die in the middle of step 10's background DCP write."""
    original = HashingWriter.write_data

    def write_data(self: HashingWriter, plan: Any, planner: Any) -> Any:
        if Path(self.path).name == STEP10:
            (Path(self.path) / "__partial").write_bytes(b"half a checkpoint")
            os._exit(17)
        return original(self, plan, planner)

    HashingWriter.write_data = write_data  # type: ignore[method-assign]
    train(env, raw, "never.pt")


def test_async_save_survives_a_kill_mid_write_and_resumes_bitwise_like_a_synchronous_one(
    sync_run: tuple[Path, list[float]], tmp_path: Path
) -> None:
    sync_dir, sync_losses = sync_run
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    # 8 steps, no final save: step 5 is the only commit, written in the background while steps 6.. ran.
    first = _config(
        run_dir, asynchronous=True, ranks=2, trainer={"total_steps": 8}, checkpointing={"save_at_end": False}
    )
    run_distributed(train_recording_metrics, 2, first, "first", tmp_dir=tmp_path)
    assert (root / "latest").read_text() == STEP5
    assert _manifest_files(root / STEP5) == _manifest_files(sync_dir / "checkpoints" / STEP5)
    results = [torch.load(tmp_path / f"first{rank}.pt") for rank in (0, 1)]
    assert results[0]["losses"] == sync_losses[:8]
    for result in results:  # every rank reports its own timings
        assert result["metrics"] == [
            (5, "checkpoint/stall_s"),
            (5, "checkpoint/write_s"),
            (5, "checkpoint/commit_s"),
        ]

    # Resumed to 10 steps; both ranks die while writing step 10 in the background.
    raw = _config(run_dir, asynchronous=True, ranks=2)
    with pytest.raises(DistributedTestFailure, match="exited with code 17"):
        run_distributed(die_while_writing_step_10, 2, raw, tmp_dir=tmp_path)
    assert (root / STEP10 / "__partial").exists(), "the write of step 10 did not start"
    assert not (root / STEP10 / MANIFEST).exists()
    assert (root / "latest").read_text() == STEP5

    run_distributed(train, 2, raw, "resumed.pt", tmp_dir=tmp_path)
    resumed = torch.load(tmp_path / "resumed.pt")
    # Steps 1-5 come with the checkpoint's progress, 6-10 were trained again from it.
    assert resumed["steps"] == 10 and resumed["losses"] == sync_losses
    # The last save (periodic at the final step) was waited for before the run ended.
    assert (root / "latest").read_text() == STEP10
    assert _manifest_files(root / STEP10) == _manifest_files(sync_dir / "checkpoints" / STEP10)


def fail_rank_1_writing_step_10(env: RankEnv, raw: dict[str, Any], out: str) -> None:
    original = Checkpointer.write

    def write(self: Checkpointer, step: int, *args: Any, **kwargs: Any) -> Any:
        if step == 10 and env.rank == 1:
            raise OSError("disk full (injected)")
        return original(self, step, *args, **kwargs)

    Checkpointer.write = write  # type: ignore[method-assign]
    try:
        train(env, raw, "never.pt")
        message = ""
    except CheckpointError as e:
        message = str(e)
    torch.save(message, env.tmp_dir / f"{out}{env.rank}.pt")


def test_a_failed_background_write_fails_every_rank_and_is_not_committed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_distributed(
        fail_rank_1_writing_step_10, 2, _config(run_dir, asynchronous=True, ranks=2), "err", tmp_dir=tmp_path
    )
    root = run_dir / "checkpoints"
    own, other = (torch.load(tmp_path / f"err{rank}.pt") for rank in (1, 0))
    assert "disk full (injected)" in own and str(root / STEP10) in own
    assert "rank(s) [1] failed" in other and "not committed" in other
    assert not (root / STEP10 / MANIFEST).exists()
    assert (root / "latest").read_text() == STEP5


def record_saves(env: RankEnv, raw: dict[str, Any]) -> None:
    """Every step saves; each background write waits until the next step has finished training."""
    from d9d.core.context import DistributedContext
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.events import CheckpointSaved, StepFinished
    from d9d.engine.trainer import Trainer

    config = parse_config(raw)
    total = config.trainer.total_steps
    log: list[tuple[str, int]] = []
    lock = threading.Lock()
    finished = {s: threading.Event() for s in range(1, total + 2)}
    writing = [0]
    overlapped: dict[int, bool] = {}
    original = Checkpointer.write

    def write(self: Checkpointer, step: int, *args: Any, **kwargs: Any) -> Any:
        with lock:
            writing[0] += 1
            log.append(("write", step) if writing[0] == 1 else ("overlapping write", step))
        if step < total:
            overlapped[step] = finished[step + 1].wait(timeout=60)
        try:
            return original(self, step, *args, **kwargs)
        finally:
            with lock:
                writing[0] -= 1
                log.append(("written", step))

    Checkpointer.write = write  # type: ignore[method-assign]
    ctx = DistributedContext.create(config.mesh)
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 2))
    trainer.events.subscribe(StepFinished, lambda e: finished[e.step].set())
    trainer.events.subscribe(CheckpointSaved, lambda e: log.append(("committed", e.step)))
    trainer.setup()
    trainer.train()
    torch.save({"log": log, "overlapped": overlapped}, env.tmp_dir / "saves.pt")


def test_one_save_in_flight_at_a_time_while_training_goes_on(tmp_path: Path) -> None:
    raw = _config(
        tmp_path / "run", asynchronous=True, trainer={"total_steps": 4}, checkpointing={"period": 1}
    )
    run_distributed(record_saves, 1, raw, tmp_dir=tmp_path)
    saves = torch.load(tmp_path / "saves.pt")
    # Step s's write finished only after step s+1 had trained: the write ran beside the training.
    assert saves["overlapped"] == {1: True, 2: True, 3: True}
    expected = [(event, s) for s in range(1, 5) for event in ("write", "written", "committed")]
    assert saves["log"] == expected


# -- staging -------------------------------------------------------------------------------------------


def test_staging_snapshots_into_reused_host_buffers() -> None:
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state = {"model": {"w": weight, "t": weight.t()}, "optim": {"lr": [0.1], "step": torch.tensor(3.0)}}
    stager = HostStager(pin_memory=False)
    stager.reserve(state)  # allocated at start-up, filled by every save
    pointers = {k: b.data_ptr() for k, b in stager.buffers.items()}
    assert len(pointers) == 3
    first = stager.stage(state)
    assert {k: b.data_ptr() for k, b in stager.buffers.items()} == pointers
    weight.add_(100)
    state["optim"]["lr"][0] = 0.5
    assert torch.equal(first["model"]["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(first["model"]["t"], torch.arange(6, dtype=torch.float32).reshape(2, 3).t())
    assert first["optim"]["lr"] == [0.1] and first["model"]["w"].data_ptr() != weight.data_ptr()
    second = stager.stage(state)
    assert torch.equal(second["model"]["w"], weight) and second["optim"]["lr"] == [0.5]
    assert {k: b.data_ptr() for k, b in stager.buffers.items()} == pointers


def test_async_defaults_to_on_for_cuda_only() -> None:
    assert resolve_async(None, torch.device("cuda", 0)) and not resolve_async(None, torch.device("cpu"))
    assert resolve_async(True, torch.device("cpu")) and not resolve_async(False, torch.device("cuda", 0))
    checkpointing = parse_config(_config(Path("r"), asynchronous=True)).checkpointing
    assert checkpointing.async_save is True
    assert checkpointing.model_dump(mode="json")["async"] is True  # train_config.json re-parses


@pytest.mark.gpu
def test_staging_from_cuda_uses_pinned_host_memory() -> None:
    source = torch.randn(1024, 1024, device="cuda")
    stager = HostStager(pin_memory=True)
    staged = stager.stage({"model": {"w": source}, "optim": {"step": torch.tensor(1.0)}})
    ready = torch.cuda.Event()
    ready.record()
    source.mul_(2)  # queued behind the copy: the staged value is the one before
    ready.synchronize()
    assert staged["model"]["w"].is_pinned() and staged["optim"]["step"].is_pinned()
    assert staged["model"]["w"].device.type == "cpu"
    torch.testing.assert_close(staged["model"]["w"], (source / 2).cpu(), rtol=0, atol=0)


@pytest.mark.gpu
def test_async_save_on_cuda_is_on_by_default_and_writes_the_synchronous_files(tmp_path: Path) -> None:
    # None: the default, on for CUDA training (pinned staging, copies ordered by a CUDA event).
    for name, asynchronous in (("sync", False), ("async", None)):
        raw = _config(tmp_path / name, asynchronous=asynchronous)
        run_distributed(train_recording_metrics, 1, raw, name, tmp_dir=tmp_path, backend="nccl")
    sync, asyn = (torch.load(tmp_path / f"{name}0.pt") for name in ("sync", "async"))
    assert asyn["losses"] == sync["losses"] and len(sync["losses"]) == 10
    for step in (STEP5, STEP10):
        expected = _manifest_files(tmp_path / "sync" / "checkpoints" / step)
        assert _manifest_files(tmp_path / "async" / "checkpoints" / step) == expected
    assert sync["metrics"] == [(5, "checkpoint/stall_s"), (10, "checkpoint/stall_s")]
    # checkpoint/wait_s too when step 5 was still being written at step 10 (timing: not asserted)
    keys = {k for _, k in asyn["metrics"]} - {"checkpoint/wait_s"}
    assert keys == {f"checkpoint/{m}_s" for m in ("stall", "write", "commit")}
