"""Checkpoint trust on the real engine: committed steps are immutable, the commit resumed from is the newest
one that verifies, and nothing in a checkpoint runs code (docs/engine.md, "Resume semantics and checkpoint
trust model")."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.checkpoint import (
    ENGINE_STATE,
    MANIFEST,
    CheckpointError,
    LocalRunReporter,
    select_commit,
    verify_manifest,
)
from d9d.engine.checkpoint_io import UnsafeCheckpointError, read_dcp_metadata
from d9d.engine.config import parse_config
from d9d.engine.launch import run_rank
from d9d.engine.resume import check_resume
from d9d.engine.runtime import RankRuntime
from tests.harness import DistributedTestFailure, RankEnv, run_distributed

pytestmark = pytest.mark.distributed

STEP5, STEP10 = "step-00000005", "step-00000010"


def config_dict(run_dir: Path, total_steps: int = 10, **sections: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "run": {"name": "trust", "dir": str(run_dir)},
        "batching": {"global_batch_size": 4, "microbatch_size": 4},
        "trainer": {"total_steps": total_steps},
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider"},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "tests.engine_fixtures:TokenCETask"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-2}},
        "checkpointing": {"period": 5, "keep_last": 3},
        "logging": {"progress_bar": "off"},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def train(env: RankEnv, raw: dict[str, Any], out: str) -> None:
    config = parse_config(raw)
    runtime = RankRuntime(
        rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=config.run_dir
    )
    reporter = LocalRunReporter(
        config.checkpoint_dir, config.checkpointing.keep_last, on_damaged=config.checkpointing.on_damaged
    )
    result = run_rank(config, runtime, reporter)
    torch.save({"steps": result.steps, "losses": list(result.losses)}, env.tmp_dir / out)


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file under `root`."""
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def rewrite_manifest_entry(step_dir: Path, name: str) -> None:
    """Make the manifest agree with a replaced file, as an attacker with write access would."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    data = (step_dir / name).read_bytes()
    manifest["files"][name].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


class Gadget:
    """A pickle that runs a shell command when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 10 steps with commits at steps 5 and 10 (copied per test)."""
    base = tmp_path_factory.mktemp("trained")
    run_distributed(train, 1, config_dict(base / "run"), "base.pt", tmp_dir=base)
    return base / "run"


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(trained, target)  # copy2: contents and mtimes kept
    return target


def test_deleted_latest_resumes_from_newest_verified_commit_without_touching_commits(
    run_dir: Path, tmp_path: Path
) -> None:
    root = run_dir / "checkpoints"
    before = {name: snapshot(root / name) for name in (STEP5, STEP10)}
    (root / "latest").unlink()

    decision = check_resume(parse_config(config_dict(run_dir, total_steps=15)))
    assert decision.action == "resume" and decision.step == 10 and decision.step_dir == root / STEP10
    assert any("latest is missing" in w for w in decision.warnings), decision.warnings

    run_distributed(resume_then_overwrite_step_5, 1, config_dict(run_dir, total_steps=15), tmp_dir=tmp_path)
    outcome = torch.load(tmp_path / "outcome.pt")
    assert outcome["resumed_at"] == 10 and outcome["steps"] == 15
    # Saving into a committed step that verifies is refused, whoever asks.
    assert f"{root / STEP5} is already committed and verifies" in outcome["refusal"]
    for name, files in before.items():
        assert snapshot(root / name) == files, f"{name} was written again"
    assert (root / "latest").read_text() == "step-00000015"


def resume_then_overwrite_step_5(env: RankEnv, raw: dict[str, Any]) -> None:
    from d9d.core.context import DistributedContext
    from d9d.engine.trainer import Trainer

    config = parse_config(raw)
    ctx = DistributedContext.create(config.mesh)
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 3))
    trainer.setup()
    resumed_at = trainer.progress.step
    result = trainer.train()
    parts = trainer.parts
    pairs = parts.optimizer.pair_with(parts.stages.by_index)
    try:
        parts.checkpointer.save(5, pairs, parts.state.state_dict(), parts.state.rank_state_dict())
        refusal = ""
    except CheckpointError as e:
        refusal = str(e)
    torch.save(
        {"resumed_at": resumed_at, "steps": result.steps, "refusal": refusal}, env.tmp_dir / "outcome.pt"
    )


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _garbage(path: Path) -> None:
    path.write_bytes(b"not a checkpoint at all")


DAMAGE = {
    "flipped byte in .distcp": ("__0_0.distcp", _flip_byte),
    "truncated .distcp": ("__0_0.distcp", _truncate),
    "garbage engine state": (ENGINE_STATE, _garbage),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_commit_falls_back_or_fails_naming_the_file(run_dir: Path, damage: str) -> None:
    name, damage_fn = DAMAGE[damage]
    root = run_dir / "checkpoints"
    damage_fn(root / STEP10 / name)

    decision = check_resume(parse_config(config_dict(run_dir, total_steps=15)))
    assert decision.action == "resume" and decision.step_dir == root / STEP5
    assert any(f"skipping damaged commit {root / STEP10}" in w and name in w for w in decision.warnings)

    failing = config_dict(run_dir, total_steps=15, checkpointing={"on_damaged": "fail"})
    with pytest.raises(CheckpointError, match=rf"newest commit .*{STEP10} is damaged: .*{name}"):
        check_resume(parse_config(failing))


def test_engine_falls_back_and_moves_the_damaged_commit_aside(
    trained: Path, run_dir: Path, tmp_path: Path
) -> None:
    root = run_dir / "checkpoints"
    _flip_byte(root / STEP10 / "__0_0.distcp")
    damaged_bytes = (root / STEP10 / "__0_0.distcp").read_bytes()
    step5 = snapshot(root / STEP5)

    run_distributed(train, 1, config_dict(run_dir, total_steps=12), "fallback.pt", tmp_dir=tmp_path)
    result = torch.load(tmp_path / "fallback.pt")
    # Resumed at step 5 (from scratch, saving step 5 would have been refused): steps 6..10 retrained
    # exactly as the first time.
    assert result["steps"] == 12
    assert result["losses"][:10] == torch.load(trained.parent / "base.pt")["losses"]
    assert snapshot(root / STEP5) == step5
    # Step 10 was trained again and committed afresh; the damaged commit is kept, byte for byte, aside.
    verify_manifest(root / STEP10)
    (aside,) = (root / "damaged").iterdir()
    assert aside.name.startswith(STEP10) and (aside / "__0_0.distcp").read_bytes() == damaged_bytes


def test_no_verified_commit_is_an_error_naming_each_skipped_dir(run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    _truncate(root / STEP5 / ENGINE_STATE)
    _flip_byte(root / STEP10 / "__0_0.distcp")
    with pytest.raises(CheckpointError) as error:
        select_commit(root)
    message = str(error.value)
    assert "refusing to start from scratch" in message
    assert f"{root / STEP5}: {root / STEP5 / ENGINE_STATE} is" in message
    assert f"{root / STEP10}: {root / STEP10 / '__0_0.distcp'} does not match" in message
    # What the engine asks at start-up (the reporter's latest commit) refuses the same way.
    with pytest.raises(CheckpointError, match="none verifies"):
        LocalRunReporter(root, 3).latest_checkpoint()


# -- no code from checkpoints ---------------------------------------------------------------------------


def test_the_gadget_is_live(tmp_path: Path) -> None:
    """Control: plain unpickling of the gadget does run it, so the refusals below are meaningful."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Gadget(marker)))
    assert marker.exists()


@pytest.mark.parametrize("target", [".metadata", ENGINE_STATE])
def test_pickle_gadget_in_a_checkpoint_runs_nothing(run_dir: Path, tmp_path: Path, target: str) -> None:
    step_dir = run_dir / "checkpoints" / STEP10
    marker = tmp_path / "pwned"
    if target == ".metadata":
        (step_dir / target).write_bytes(pickle.dumps(Gadget(marker)))
    else:
        torch.save({"step": Gadget(marker)}, step_dir / target)
    rewrite_manifest_entry(step_dir, target)  # the manifest verifies: only the loader stands in the way

    with pytest.raises(DistributedTestFailure, match=rf"{step_dir / target}"):
        run_distributed(train, 1, config_dict(run_dir, total_steps=15), "x.pt", tmp_dir=tmp_path)
    assert not marker.exists()


def test_pickle_gadget_as_a_non_tensor_dcp_item_runs_nothing(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from d9d.engine.checkpoint_io import SafeLoadPlanner, SafeReader

    marker = tmp_path / "pwned"
    dcp.save(
        {"w": torch.ones(2), "extra": Gadget(marker)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True
    )
    assert not marker.exists()
    state: dict[str, Any] = {"w": torch.zeros(2), "extra": None}
    # DCP wraps what a rank raised into a CheckpointException (a BaseException).
    with pytest.raises(
        CheckpointException, match=r"item extra of the checkpoint is not plain data.*posix\.system"
    ):
        dcp.load(
            state,
            storage_reader=SafeReader(tmp_path / "ckpt"),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert not marker.exists()


def test_dcp_metadata_reader_accepts_real_metadata_and_names_the_file(run_dir: Path) -> None:
    path = run_dir / "checkpoints" / STEP10 / ".metadata"
    metadata = read_dcp_metadata(path)
    assert any(key.startswith("app.model.") for key in metadata.state_dict_metadata)
    path.write_bytes(pickle.dumps(Gadget(path.parent / "pwned")))
    with pytest.raises(
        UnsafeCheckpointError, match=rf"{path} is not a checkpoint metadata file: .*posix\.system"
    ):
        read_dcp_metadata(path)
    assert not (path.parent / "pwned").exists()


def test_commit_without_identity_still_names_the_mismatching_key(run_dir: Path, tmp_path: Path) -> None:
    """A commit from before run identities: DCP's size check names the key."""
    step_dir = run_dir / "checkpoints" / STEP10
    (step_dir / "identity.json").unlink()
    manifest = json.loads((step_dir / MANIFEST).read_text())
    del manifest["files"]["identity.json"]
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    narrow = config_dict(run_dir, total_steps=15, model={"options": {"width": 8}})
    with pytest.raises(
        DistributedTestFailure,
        match=r"cannot load .*step-00000010 into this model: Size mismatch between "
        r"saved torch.Size\(\[32, 16\]\) and current: torch.Size\(\[32, 8\]\) for model key embed\.weight",
    ):
        run_distributed(train, 1, narrow, "x.pt", tmp_dir=tmp_path)


def test_coordinator_store_skips_and_moves_damaged_commits_and_never_writes_a_commit(run_dir: Path) -> None:
    from d9d.cluster.checkpoints import CheckpointStore

    root = run_dir / "checkpoints"
    _flip_byte(root / STEP10 / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=rf"{STEP10} is damaged: .*__0_0\.distcp does not match"):
        CheckpointStore(root, 3, on_damaged="fail").latest()
    store = CheckpointStore(root, 3)
    latest = store.latest()
    assert latest is not None and latest.step == 5
    step5 = snapshot(root / STEP5)
    store.clear_uncommitted()  # what the coordinator does before each attempt
    assert not (root / STEP10).exists() and len(list((root / "damaged").iterdir())) == 1
    with pytest.raises(CheckpointError, match=rf"{STEP5} is committed; a committed step is never written"):
        store.write_chunk(5, "__0_0.distcp", 0, b"overwrite")
    assert snapshot(root / STEP5) == step5
