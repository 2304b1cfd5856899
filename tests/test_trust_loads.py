"""No code from any file d9d reads, and nothing read that its manifest does not vouch for: a crafted pickle
per entry point (export through the CLI, a PEFT export and resume, training resume, inference progress)
with a marker file that must not appear, and doctored manifests (emptied, a file left out, a stale hash).

The gadgets are live: `test_the_bytes_item_gadget_is_live` shows DCP's own planner runs the crafted
`.distcp` item that the export must refuse."""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from d9d.cli.main import main
from d9d.engine.checkpoint import ENGINE_STATE, MANIFEST, TRAIN_CONFIG, CheckpointError
from d9d.engine.checkpoint_io import METADATA, read_dcp_metadata
from d9d.engine.config import parse_config
from d9d.engine.resume import check_resume
from tests.harness import DistributedTestFailure, run_distributed
from tests.test_checkpoint_trust import Gadget, config_dict, rewrite_manifest_entry, train

pytestmark = pytest.mark.distributed

STEP10 = "step-00000010"
PEFT_MODEL = {
    "provider": "peft",
    "options": {
        "base": {"provider": "tests.engine_fixtures:TinyLMProvider"},
        "method": {"kind": "lora", "target_modules": "hidden", "rank": 2, "alpha": 4.0},
    },
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 steps of the tiny LM, commits at 5 and 10 (copied per test)."""
    base = tmp_path_factory.mktemp("trained")
    run_distributed(train, 1, config_dict(base / "run"), "base.pt", tmp_dir=base)
    return base / "run"


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(trained, target)
    return target


def _export(run_dir: Path, dest: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    code = main(["export", str(run_dir), "--hf", str(dest), *extra])
    return code, capsys.readouterr().err


@pytest.fixture(autouse=True)
def _log_to_this_stderr() -> None:
    """The d9d logger's handler keeps the stderr of the test that created it; point it at this one."""
    import logging
    import sys

    for handler in logging.getLogger("d9d").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.stream = sys.stderr  # setStream would flush the old, closed one


def _one_clear_line(err: str) -> None:
    """The error is one line (besides the log's info lines), with no traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert [ln for ln in lines if ln.startswith("d9d export: ")] == lines[-1:], err


def _bytes_item_gadget(step_dir: Path, marker: Path, key: str = "app.model.embed.weight") -> None:
    """The issue's attack: `.metadata` built only from allow-listed types says `key` is a bytes item stored
    after the end of the `.distcp` file, where a pickled gadget is appended; the manifest is rewritten to
    match, so only the loader stands in the way."""
    metadata = read_dcp_metadata(step_dir / METADATA)
    payload = pickle.dumps(Gadget(marker), protocol=2)
    distcp = step_dir / "__0_0.distcp"
    offset = distcp.stat().st_size
    with distcp.open("ab") as f:
        f.write(payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    assert metadata.storage_data is not None
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", offset, len(payload))
    (step_dir / METADATA).write_bytes(pickle.dumps(metadata))
    read_dcp_metadata(step_dir / METADATA)  # still only allow-listed types: the metadata reader accepts it
    rewrite_manifest_entry(step_dir, METADATA)
    rewrite_manifest_entry(step_dir, "__0_0.distcp")


def test_the_bytes_item_gadget_is_live(run_dir: Path, tmp_path: Path) -> None:
    """Control: DCP's default planner runs the crafted item, so the export's refusal below is meaningful."""
    import torch.distributed.checkpoint as dcp

    from d9d.engine.checkpoint_io import SafeReader

    step_dir = run_dir / "checkpoints" / STEP10
    marker = tmp_path / "ran"
    _bytes_item_gadget(step_dir, marker)
    state = {"app": {"model": {"embed.weight": torch.zeros(32, 16)}}}
    with contextlib.suppress(BaseException):  # the gadget's return value is no tensor; it ran already
        dcp.load(state, storage_reader=SafeReader(step_dir), no_dist=True)
    assert marker.exists()


# -- d9d export (CLI) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [METADATA, "bytes item"])
def test_export_runs_no_pickle_and_says_so_in_one_line(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    step_dir = run_dir / "checkpoints" / STEP10
    marker = tmp_path / "pwned"
    if target == METADATA:
        (step_dir / METADATA).write_bytes(pickle.dumps(Gadget(marker)))
        rewrite_manifest_entry(step_dir, METADATA)
        expected = f"{step_dir / METADATA} is not a checkpoint metadata file"
    else:
        _bytes_item_gadget(step_dir, marker)
        expected = (
            "item model key embed.weight of the checkpoint is not plain data: "
            "Trying to load unsupported GLOBAL posix.system"
        )
    code, err = _export(run_dir, tmp_path / "out", capsys)
    assert code == 2 and expected in err, err
    _one_clear_line(err)
    assert not marker.exists() and not (tmp_path / "out").exists()


def _empty_files(step_dir: Path) -> None:
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"] = {}
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def _unlist(name: str) -> Any:
    def doctor(step_dir: Path) -> None:
        manifest = json.loads((step_dir / MANIFEST).read_text())
        del manifest["files"][name]
        (step_dir / MANIFEST).write_text(json.dumps(manifest))

    return doctor


def _flip_weights(step_dir: Path) -> None:
    path = step_dir / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))  # the manifest is stale now


def _gadget_engine_state(step_dir: Path) -> None:
    torch.save({"step": Gadget(step_dir.parent.parent / "pwned")}, step_dir / ENGINE_STATE)  # stale manifest


DOCTORED = {
    "manifest emptied": (_empty_files, "it lists no files"),
    "metadata left out": (_unlist(METADATA), f"does not list {METADATA}"),
    "data file left out": (_unlist("__0_0.distcp"), "does not list __0_0.distcp"),
    "train config left out": (_unlist(TRAIN_CONFIG), f"does not list {TRAIN_CONFIG}"),
    "weights flipped, stale manifest": (_flip_weights, "__0_0.distcp does not match the sha256"),
    "gadget engine.pt, stale manifest": (_gadget_engine_state, f"/{ENGINE_STATE} is "),
}


@pytest.mark.parametrize("case", sorted(DOCTORED))
def test_export_refuses_a_commit_its_manifest_does_not_vouch_for(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    doctor, expected = DOCTORED[case]
    doctor(run_dir / "checkpoints" / STEP10)
    code, err = _export(run_dir, tmp_path / "out", capsys)
    assert code == 2 and expected in err and "refus" in err, err
    _one_clear_line(err)
    assert not (run_dir / "pwned").exists() and not (tmp_path / "out").exists()


def test_export_of_an_intact_commit_still_works(run_dir: Path, tmp_path: Path, capsys: Any) -> None:
    code, err = _export(run_dir, tmp_path / "out", capsys)
    assert code == 0, err


# -- training resume --------------------------------------------------------------------------------------


def test_resume_refuses_files_the_manifest_does_not_list(run_dir: Path, tmp_path: Path) -> None:
    """engine.pt intact but not listed: before, the verification passed (it checks what is listed) and the
    engine loaded the unverified file."""
    step_dir = run_dir / "checkpoints" / STEP10
    _unlist(ENGINE_STATE)(step_dir)
    with pytest.raises(DistributedTestFailure, match=rf"{MANIFEST} does not list {ENGINE_STATE}"):
        run_distributed(train, 1, config_dict(run_dir, total_steps=12), "x.pt", tmp_dir=tmp_path)


def test_resume_refuses_an_unlisted_identity(run_dir: Path) -> None:
    step_dir = run_dir / "checkpoints" / STEP10
    _unlist("identity.json")(step_dir)
    with pytest.raises(CheckpointError, match=r"does not list identity.json"):
        check_resume(parse_config(config_dict(run_dir, total_steps=12)))


# -- PEFT: export of the adapter and resume of a trainable-only checkpoint ---------------------------------


@pytest.fixture(scope="module")
def peft_trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("peft")
    raw = config_dict(base / "run", total_steps=4, model=PEFT_MODEL)
    raw["checkpointing"] = {"period": 2, "keep_last": 2, "trainable_only": True}
    run_distributed(train, 1, raw, "peft.pt", tmp_dir=base)
    return base / "run"


@pytest.mark.parametrize("entry", ["export --adapter", "resume"])
def test_peft_checkpoint_gadget_runs_nothing(
    peft_trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: str
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(peft_trained, run_dir)
    step_dir = run_dir / "checkpoints" / "step-00000004"
    marker = tmp_path / "pwned"
    key = next(
        k for k in read_dcp_metadata(step_dir / METADATA).state_dict_metadata if k.startswith("app.model.")
    )
    _bytes_item_gadget(step_dir, marker, key)
    if entry == "resume":
        raw = config_dict(run_dir, total_steps=6, model=PEFT_MODEL)
        raw["checkpointing"] = {"period": 2, "keep_last": 2, "trainable_only": True}
        with pytest.raises(DistributedTestFailure, match="is not plain data"):
            run_distributed(train, 1, raw, "x.pt", tmp_dir=tmp_path)
    else:
        code, err = _export(run_dir, tmp_path / "out", capsys, "--adapter")
        assert code == 2 and "is not plain data" in err, err
        _one_clear_line(err)
    assert not marker.exists()


# -- inference progress -------------------------------------------------------------------------------------


def _inference(run_dir: Path, checkpoint: Path) -> Any:
    from d9d.core import DistributedContext
    from d9d.engine.inference import Inference, InferenceConfig

    config = InferenceConfig.model_validate(
        {
            "run": {"name": "ppl", "dir": str(run_dir)},
            "microbatch_size": 2,
            "save_period": 1,
            "model": {"provider": "qwen3", "options": {"source_checkpoint": str(checkpoint)}},
            "data": {"provider": "tests.engine_fixtures:FiniteTokens", "options": {"num_samples": 8}},
        }
    )
    return Inference(config, DistributedContext.local())


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine_fixtures import make_hf_qwen3

    path = tmp_path_factory.mktemp("hf")
    make_hf_qwen3(path, num_layers=1)
    return path


def _saved_progress(run_dir: Path, checkpoint: Path) -> tuple[Path, Path]:
    """Two steps of inference, saved (as an interrupted run leaves them); returns (manifest, state file)."""
    runner = _inference(run_dir, checkpoint)
    runner.setup()
    for _ in range(2):
        runner.data.next_step()
        runner.steps += 1
    runner._save()
    manifest = run_dir / "inference_state.json"
    return manifest, run_dir / json.loads(manifest.read_text())["file"]


def test_inference_progress_resumes_when_it_verifies(tmp_path: Path, hf_checkpoint: Path) -> None:
    _saved_progress(tmp_path / "run", hf_checkpoint)
    resumed = _inference(tmp_path / "run", hf_checkpoint)
    resumed.setup()
    assert resumed.steps == 2 and resumed.data.state_dict() == {"position": 4}


def test_inference_progress_gadget_and_doctored_manifest_are_refused(
    tmp_path: Path, hf_checkpoint: Path
) -> None:
    from d9d.engine.checkpoint_io import UnsafeCheckpointError

    run_dir = tmp_path / "run"
    manifest, state = _saved_progress(run_dir, hf_checkpoint)
    marker = tmp_path / "pwned"
    torch.save({"steps": Gadget(marker)}, state)
    # Stale manifest: refused on the hash, before anything is unpickled.
    with pytest.raises(CheckpointError, match=rf"{state} does not match the size and sha256"):
        _inference(run_dir, hf_checkpoint).setup()
    # The manifest rewritten to match: refused by the weights-only loader, naming the file.
    data = state.read_bytes()
    manifest.write_text(
        json.dumps({"file": state.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    )
    with pytest.raises(UnsafeCheckpointError, match=rf"{state} cannot be loaded as plain state"):
        _inference(run_dir, hf_checkpoint).setup()
    # No manifest at all: nothing vouches for the file.
    manifest.unlink()
    with pytest.raises(CheckpointError, match="without its manifest"):
        _inference(run_dir, hf_checkpoint).setup()
    assert not marker.exists()
