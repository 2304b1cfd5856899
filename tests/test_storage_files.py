"""A run with a storage root elsewhere (`run.storage`): besides its checkpoints and summary, its tracker files
(MLflow store, JSON lines, TensorBoard events, history, plot) and its Hugging Face export land there, and the
commands that read a run's files (`d9d status/list/logs/plot/export`) read them from a storage URI.

Checked against the loopback S3 server of tests/test_storage.py and against `memory://`: the copies equal
the local files the trackers wrote (the MLflow copy opened by MLflow itself), the export's tensors equal the
local export's, and a store that cannot be read gives an error naming its URI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.torch import load, load_file

from d9d.cli.main import main
from d9d.cluster.registry import RECORD_FILE, RunRecord
from d9d.cluster.state import RunSummary, record_launch
from d9d.core.storage import (
    StoragePath,
    TreeMirror,
    copy_tree,
    list_files,
    location,
    write_text,
)
from d9d.engine.tracking_sink import run_files_mirror
from d9d.tracking import LogTrackerConfig, MultiTrackerConfig, TensorBoardTrackerConfig
from tests.engine_fixtures import VOCAB, subprocess_env
from tests.test_storage import BUCKET, memory_root, s3

__all__ = ["s3"]  # the module-scoped S3 server fixture, shared with tests/test_storage.py

ARCH = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_layers": 1,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
}


def _relative_files(root: Any) -> dict[str, bytes]:
    base = str(root).rstrip("/") + "/"
    return {str(f).removeprefix(base): f.read_bytes() for f in list_files(root)}


# -- the mirror ------------------------------------------------------------------------------------------


def test_a_mirror_sends_only_what_changed_and_json_last(tmp_path: Path) -> None:
    root = memory_root("mirror")
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.1").write_bytes(b"e1")
    (tmp_path / "index.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("a\n")
    mirror = TreeMirror(
        root,
        {
            "tb": tmp_path / "tb",
            "index.json": tmp_path / "index.json",
            "metrics.jsonl": tmp_path / "metrics.jsonl",
            "missing": tmp_path / "not-written-yet",
        },
    )
    sent = [str(p).removeprefix(str(root) + "/") for p in mirror.sync()]
    assert sent == ["metrics.jsonl", "tb/events.1", "index.json"]  # the JSON that may name others goes last
    assert mirror.sync() == []  # nothing changed
    time.sleep(0.01)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write("b\n")
    (tmp_path / "tb" / "events.2").write_bytes(b"e2")
    assert sorted(str(p).rsplit("/", 1)[-1] for p in mirror.sync()) == ["events.2", "metrics.jsonl"]
    assert _relative_files(root) == {
        "index.json": b"{}",
        "metrics.jsonl": b"a\nb\n",
        "tb/events.1": b"e1",
        "tb/events.2": b"e2",
    }
    # On a new node: what is missing locally comes back from the copies, what is there stays as it is,
    # and restored files are not sent again.
    shutil.rmtree(tmp_path / "tb")
    (tmp_path / "metrics.jsonl").write_text("local\n")
    again = TreeMirror(root, {"tb": tmp_path / "tb", "metrics.jsonl": tmp_path / "metrics.jsonl"})
    assert sorted(p.name for p in again.restore()) == ["events.1", "events.2"]
    assert (tmp_path / "tb" / "events.2").read_bytes() == b"e2"
    assert (tmp_path / "metrics.jsonl").read_text() == "local\n"
    assert [str(p).rsplit("/", 1)[-1] for p in again.sync()] == ["metrics.jsonl"]
    # A target that is the source itself (the storage root is the run directory) is left alone.
    assert TreeMirror(tmp_path, {"tb": tmp_path / "tb"}).sync() == []


def test_copy_tree_leaves_the_target_equal_to_the_source(tmp_path: Path) -> None:
    root = memory_root("copy") / "export"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model-1.safetensors").write_bytes(b"w1")
    (tmp_path / "a" / "model-2.safetensors").write_bytes(b"w2")
    copy_tree(tmp_path / "a", root)
    (tmp_path / "a" / "model-2.safetensors").unlink()  # a re-export with fewer shards
    copy_tree(tmp_path / "a", root)
    assert _relative_files(root) == {"model-1.safetensors": b"w1"}


def test_the_run_files_mirror_keeps_run_dir_paths_and_skips_a_storage_root_that_is_the_run_dir(
    tmp_path: Path,
) -> None:
    config = MultiTrackerConfig(
        trackers=(LogTrackerConfig(jsonl="m/metrics.jsonl"), TensorBoardTrackerConfig(log_dir="tb"))
    )
    mirror = run_files_mirror(config, tmp_path, memory_root("names"))
    assert mirror is not None
    assert sorted(mirror.sources) == sorted(
        ["m/metrics.jsonl", "tb", "tracker_state.json", "history.jsonl", "plots/training.png", "logs"]
    )
    assert run_files_mirror(config, tmp_path, tmp_path) is None


# -- a whole run on S3 ---------------------------------------------------------------------------------


def _options_args(options: dict[str, Any]) -> list[str]:
    return [arg for k, v in options.items() for arg in ("--storage-option", f"{k}={v}")]


_TWO_LAUNCHES = """
import json, sys
from pathlib import Path
from d9d.core.storage import list_files, location
from d9d.engine.launch import main

job, options, snapshot, *second = sys.argv[1:]
assert main([job]) == 0
root = location("s3://%s/files/tracked" % "BUCKET", json.loads(options))
for f in list_files(root):
    local = Path(snapshot, str(f).removeprefix(str(root) + "/"))
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(f.read_bytes())
assert main([job, *[a for item in second for a in ("--set", item)]]) == 0
""".replace("BUCKET", BUCKET)


@pytest.fixture(scope="module")
def s3_run(
    s3: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, StoragePath, dict[str, bytes]]:
    """A 4-step run through the engine's launcher with run.storage on S3, MLflow + JSON lines + TensorBoard,
    and a Hugging Face export; then (after a snapshot of the storage root) the same run continued to step 6
    from a new, empty run directory, as on another node."""
    tmp = tmp_path_factory.mktemp("s3run")
    job = {
        "run": {
            "name": "tracked",
            "dir": str(tmp / "local"),
            "storage": {"uri": f"s3://{BUCKET}/files", "options": s3},
        },
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": 4},
        "model": {"provider": "qwen3", "options": {"architecture": ARCH}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-2}},
        "checkpointing": {"export_hf_dir": str(tmp / "export")},
        "logging": {
            "progress_bar": "off",
            "tracker": [
                {"kind": "mlflow"},
                {"kind": "log", "stdout": False},
                {"kind": "tensorboard", "flush_secs": 0.1},
            ],
        },
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    root = location(f"s3://{BUCKET}/files", s3) / "tracked"
    assert isinstance(root, StoragePath)
    # Both launches in one process (imports once), a snapshot of the storage root between them.
    second = [
        f"run.dir={tmp / 'local2'}",
        "trainer.total_steps=6",
        f"checkpointing.export_hf_dir={tmp / 'export2'}",
    ]
    done = subprocess.run(
        [sys.executable, "-c", _TWO_LAUNCHES, str(path), json.dumps(s3), str(tmp / "first"), *second],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first = {
        p.relative_to(tmp / "first").as_posix(): p.read_bytes()
        for p in (tmp / "first").rglob("*")
        if p.is_file()
    }
    return tmp, root, first


def _mlflow_losses(db: Path) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "d9d"]
    (run,) = client.search_runs([experiment.experiment_id])
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss"))


def test_tracker_files_and_the_export_land_in_the_s3_storage_root(
    s3_run: tuple[Path, StoragePath, dict[str, bytes]], tmp_path: Path
) -> None:
    tmp, _, on_s3 = s3_run  # the storage root as the first launch left it
    local = tmp / "local"
    for name in ("metrics.jsonl", "history.jsonl", "tracker_state.json", "plots/training.png"):
        assert on_s3[name] == (local / name).read_bytes(), name
    events = sorted(p.relative_to(local).as_posix() for p in (local / "tensorboard").iterdir())
    assert events and all(on_s3[name] == (local / name).read_bytes() for name in events)
    records = [json.loads(line) for line in on_s3["metrics.jsonl"].decode().splitlines()]
    assert [r["step"] for r in records if r["event"] == "scalars" and "train/loss" in r["values"]] == [
        1,
        2,
        3,
        4,
    ]

    # The MLflow store on S3 is a whole SQLite file that MLflow opens, with the run's losses.
    copy = tmp_path / "mlflow.db"
    copy.write_bytes(on_s3["mlflow.db"])
    losses = _mlflow_losses(copy)
    assert [step for step, _ in losses] == [1, 2, 3, 4]
    assert losses == _mlflow_losses(local / "mlflow.db")

    # The export: every file of the local one, the weights tensor for tensor.
    export = tmp / "export"
    names = sorted(p.name for p in export.iterdir())
    assert sorted(n.removeprefix("export/") for n in on_s3 if n.startswith("export/")) == names
    weights = [n for n in names if n.endswith(".safetensors")]
    assert weights
    for name in weights:
        remote, mine = load(on_s3[f"export/{name}"]), load_file(export / name)
        assert remote.keys() == mine.keys() and all(remote[k].equal(mine[k]) for k in mine)
    assert on_s3["export/config.json"] == (export / "config.json").read_bytes()
    # The checkpoints went there too, and nothing durable to the local run directory.
    assert on_s3["checkpoints/latest"] == b"step-00000004"
    assert not (local / "checkpoints").exists()


def test_a_run_continued_from_a_new_run_dir_continues_its_tracker_files_on_s3(
    s3_run: tuple[Path, StoragePath, dict[str, bytes]], tmp_path: Path
) -> None:
    tmp, root, first = s3_run
    on_s3 = _relative_files(root)
    assert on_s3["checkpoints/latest"] == b"step-00000006"
    # The new run directory got the tracker's files back before the tracker opened: the JSON lines and
    # the history go on from the first launch's, and MLflow continues the same run (steps 1..6 in one).
    for name in ("metrics.jsonl", "history.jsonl"):
        assert on_s3[name].startswith(first[name]) and on_s3[name] == (tmp / "local2" / name).read_bytes()
    records = [json.loads(line) for line in on_s3["metrics.jsonl"].decode().splitlines()]
    assert [r["step"] for r in records if r["event"] == "scalars" and "train/loss" in r["values"]] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    copy = tmp_path / "mlflow.db"
    copy.write_bytes(on_s3["mlflow.db"])
    earlier = tmp_path / "mlflow-first.db"
    earlier.write_bytes(first["mlflow.db"])
    losses = _mlflow_losses(copy)
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6] and losses[:4] == _mlflow_losses(earlier)
    # The export is the second launch's.
    export = tmp / "export2"
    assert on_s3["export/config.json"] == (export / "config.json").read_bytes()
    for name in (p.name for p in export.iterdir() if p.suffix == ".safetensors"):
        remote, mine = load(on_s3[f"export/{name}"]), load_file(export / name)
        assert all(remote[k].equal(mine[k]) for k in mine)


def test_plot_and_export_read_the_run_from_its_s3_uri(
    s3_run: tuple[Path, StoragePath, dict[str, bytes]],
    s3: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import transformers

    _, root, _ = s3_run
    png = tmp_path / "plot.png"
    assert main(["plot", str(root), "-o", str(png), *_options_args(s3)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "6 steps" in capsys.readouterr().out

    # `d9d export` reads the committed step from S3 and writes the export back there.
    dest = f"s3://{BUCKET}/exports/tracked"
    assert main(["export", str(root), "--hf", dest, *_options_args(s3)]) == 0
    exported = location(dest, s3)
    local = tmp_path / "hf"
    local.mkdir()
    for name, data in _relative_files(exported).items():
        (local / name).write_bytes(data)
    model = transformers.AutoModelForCausalLM.from_pretrained(local)
    trained = _relative_files(root / "export")
    weights = {
        k: v for name, data in trained.items() if name.endswith(".safetensors") for k, v in load(data).items()
    }
    state = model.state_dict()
    assert weights and all(state[k].equal(v) for k, v in weights.items())
    # A second export to the same place is refused without --overwrite.
    assert main(["export", str(root), "--hf", dest, *_options_args(s3)]) == 2
    assert "not empty" in capsys.readouterr().err


# -- finding runs in a storage root --------------------------------------------------------------------


def _register(root: Any, name: str, status: str, losses: dict[int, float]) -> None:
    run_root = root / name
    record = RunRecord(name, f"/nowhere/{name}", "L1", 0.0, None, None, None, False, "host:1", str(run_root))
    write_text(run_root / RECORD_FILE, json.dumps(record.__dict__))
    summary = RunSummary(name, status, max(losses), 0, losses=losses, launch_id="L1")
    record_launch(run_root, summary)
    write_text(run_root / "logs" / "rank0.log", f"{name} says hello\n")


def test_list_status_and_logs_read_a_storage_uri(capsys: pytest.CaptureFixture[str]) -> None:
    root = memory_root("registry")
    _register(root, "alpha", "finished", {1: 2.5, 2: 1.25})
    _register(root, "beta", "failed", {1: 3.0})
    assert main(["list", "--runs-root", str(root)]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["alpha"][1:4] == ["finished", "2", "1.25"] and rows["beta"][1:4] == ["failed", "1", "3"]

    assert main(["status", str(root / "alpha"), "--address", "http://127.0.0.1:1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "finished"
    assert main(["status", "beta", "--storage", str(root), "--address", "http://127.0.0.1:1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 1
    assert main(["status", "beta", "--storage", str(root), "--address", "http://127.0.0.1:1"]) == 0
    human = capsys.readouterr().out
    assert human.startswith("run beta: failed (Ray; read from files)") and "loss:        3.0000" in human

    assert main(["logs", str(root / "alpha"), "--address", "http://127.0.0.1:1"]) == 0
    assert "alpha says hello" in capsys.readouterr().out


def test_a_store_that_cannot_be_read_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--runs-root", "nope://bucket/runs"]) == 2
    assert "nope://" in capsys.readouterr().err
    assert main(["status", "nope://bucket/runs/x", "--address", "http://127.0.0.1:1"]) == 2
    assert "nope://bucket/runs/x" in capsys.readouterr().err
    missing = str(memory_root("empty") / "gone")
    assert main(["status", missing, "--address", "http://127.0.0.1:1"]) == 1
    assert missing in capsys.readouterr().err
    assert main(["plot", missing]) == 2
    assert missing in capsys.readouterr().err
    # An S3 endpoint that does not answer (one attempt, not botocore's retries).
    dead = {
        "endpoint_url": "http://127.0.0.1:1",
        "key": "k",
        "secret": "s",
        "config_kwargs": "{retries: {max_attempts: 1}}",
    }
    assert main(["list", "--runs-root", "s3://bucket/runs", *_options_args(dead)]) == 2
    assert "cannot read s3://bucket/runs" in capsys.readouterr().err


def test_submit_pins_no_local_dir_of_a_run_kept_in_an_object_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With run.storage on an object store, a relative run.dir and export dir are the cluster's node-local
    scratch (what the run keeps is copied to the store): nothing to pin, nothing the cluster must see."""
    from d9d.cluster.reach import pin_relative_paths
    from d9d.cluster.spec import build_job

    monkeypatch.chdir(tmp_path)
    job = {
        "run": {"name": "scratch", "storage": "memory://bucket/runs", "resume_from": "old/step-00000004"},
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": 2},
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider"},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "tests.engine_fixtures:TokenCETask"},
        "optimizer": {"provider": "adamw"},
        "checkpointing": {"export_hf_dir": "export"},
    }
    pinned = pin_relative_paths(job, build_job(json.loads(json.dumps(job)), cpu=True))
    assert pinned.overrides == [
        f"run.resume_from={tmp_path / 'old' / 'step-00000004'}"
    ]  # an input: still pinned
    assert not (tmp_path / "runs").exists() and not (tmp_path / "export").exists()
