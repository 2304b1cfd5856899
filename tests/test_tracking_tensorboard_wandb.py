"""TensorBoard and W&B trackers write files their own readers load back; several trackers at once; the
grouped metric names; the preflight of tracker configs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from d9d.engine.runtime import MetricPoint
from d9d.engine.tracking_sink import STATE_FILE, TrackerSink, metric_names
from d9d.tracking import (
    LogTrackerConfig,
    MultiTracker,
    MultiTrackerConfig,
    RunSpec,
    TensorBoardTrackerConfig,
    TrackerConfig,
    TrackerError,
    WandbTrackerConfig,
    build_tracker,
    check_tracker,
    tracker_locations,
)
from d9d.tracking.tensorboard_tracker import TensorBoardTracker
from d9d.tracking.wandb_tracker import WandbTracker

RUN = RunSpec("tiny", params={"optim": {"lr": 0.001}, "seed": 3, "layers": [2, 4]}, tags={"launcher": "test"})


def _approx(series: dict[str, dict[int, float]]) -> dict[str, object]:
    """Float32 event values (TensorBoard) against float64 expectations."""
    return {name: pytest.approx(values) for name, values in series.items()}


def _scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar tag of a TensorBoard directory, read with TensorBoard's own loader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _wandb_records(path: Path) -> list[object]:
    """The records of a `.wandb` transaction log, parsed with W&B's own protobuf `Record`.

    The file is a LevelDB-style log: a 7-byte header (`:W&B`, magic 0xBEE1, version), then 32 KiB blocks of
    records, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _wandb_history(run_dir: Path) -> dict[str, dict[int, float]]:
    (log,) = run_dir.glob("run-*.wandb")
    series: dict[str, dict[int, float]] = {}
    for record in _wandb_records(log):
        if record.WhichOneof("record_type") != "history":  # type: ignore[attr-defined]
            continue
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}  # type: ignore[attr-defined]
        step = int(items.pop("_step"))
        for key, value in items.items():
            if not key.startswith("_"):
                series.setdefault(key, {})[step] = value
    return series


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    tracker = TensorBoardTracker(log_dir)
    tracker.open(RUN)
    for step in (1, 2, 3):
        tracker.log_scalars(step, {"train/loss": 1.0 / step, "train/lr": 0.1 * step})
    values = np.arange(100, dtype=np.float64)
    tracker.log_histogram(3, "train/weights", values)
    tracker.close()
    scalars = _scalars(log_dir)
    assert scalars["train/loss"] == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3})
    assert scalars["train/lr"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"histograms": 0, "tensors": 0})
    acc.Reload()
    (histogram,) = acc.Histograms("train/weights")
    assert histogram.step == 3
    assert histogram.histogram_value.num == 100 and histogram.histogram_value.sum == values.sum()
    assert histogram.histogram_value.max == 99.0 and sum(histogram.histogram_value.bucket) == 100
    (text,) = acc.Tensors("run/params")
    assert "optim.lr" in text.tensor_proto.string_val[0].decode()
    # The HPARAMS tab: every parameter (a list as its JSON), the final loss as the metric.
    from tensorboard.plugins.hparams import metadata as hparams_metadata

    data = acc.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
    experiment = hparams_metadata.parse_experiment_plugin_data(data[hparams_metadata.EXPERIMENT_TAG])
    assert {h.name for h in experiment.hparam_infos} == {"optim.lr", "seed", "layers", "tag.launcher"}
    assert [m.name.tag for m in experiment.metric_infos] == ["hparams/final_loss", "train/loss"]
    start = hparams_metadata.parse_session_start_info_plugin_data(
        data[hparams_metadata.SESSION_START_INFO_TAG]
    )
    assert start.hparams["optim.lr"].number_value == 0.001 and start.hparams["seed"].number_value == 3
    assert start.hparams["layers"].string_value == "[2, 4]"
    assert start.hparams["tag.launcher"].string_value == "test"
    assert scalars["hparams/final_loss"] == pytest.approx({3: 1 / 3})  # the last loss, where it was logged

    # Resume: a second event file in the same directory; steps it already holds are not written again.
    again = TensorBoardTracker(log_dir)
    again.open(RUN, resume=tracker.resume_state())
    again.log_scalars(3, {"train/loss": 99.0})
    again.log_scalars(4, {"train/loss": 0.25})
    again.close()
    assert _scalars(log_dir)["train/loss"] == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3, 4: 0.25})
    assert _scalars(log_dir)["hparams/final_loss"] == pytest.approx({3: 1 / 3, 4: 0.25})  # the newest wins


def test_wandb_offline_run_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = build_tracker(WandbTrackerConfig(project="p"), tmp_path)
    assert isinstance(tracker, WandbTracker) and tracker.mode == "offline"
    tracker.open(RUN)
    run_dir = tracker.run_dir
    assert run_dir is not None and run_dir.parent == tmp_path / "wandb"
    for step in (1, 2, 3):
        tracker.log_scalars(step, {"train/loss": 1.0 / step, "system/rank0/rss_bytes": 1e6 * step})
    tracker.log_scalars(2, {"train/loss": 7.0})  # behind W&B's step: dropped, not an error
    state = tracker.resume_state()
    tracker.close()
    assert state["kind"] == "wandb" and state["run_id"] in run_dir.name
    history = _wandb_history(run_dir)
    assert history["train/loss"] == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3})
    assert history["system/rank0/rss_bytes"] == pytest.approx({1: 1e6, 2: 2e6, 3: 3e6})


def test_several_trackers_at_once_through_the_sink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")

    class Logging(BaseModel):
        tracker: TrackerConfig

    # A list is several trackers.
    config = Logging.model_validate(
        {"tracker": [{"kind": "tensorboard"}, {"kind": "log", "stdout": False}, {"kind": "wandb"}]}
    ).tracker
    assert isinstance(config, MultiTrackerConfig) and len(config.trackers) == 3
    tracker = build_tracker(config, tmp_path)
    assert isinstance(tracker, MultiTracker)
    sink = TrackerSink(tracker, RUN, tmp_path / STATE_FILE, resume=False)
    sink.write(
        [
            MetricPoint(1, 0, {"loss": 2.0, "lr": 0.01}),
            MetricPoint(1, 1, {"rss_bytes": 5.0}, "health"),
            MetricPoint(1, -1, {"world_size": 2.0}, "health"),
        ]
    )
    sink.write([MetricPoint(2, 0, {"loss": 1.5, "lr": 0.02}), MetricPoint(2, 0, {"loss": 1.7}, "eval")])
    sink.close("finished")

    expected = {
        "train/loss": {1: 2.0, 2: 1.5},
        "train/lr": {1: 0.01, 2: 0.02},
        "system/rank1/rss_bytes": {1: 5.0},
        "system/cluster/world_size": {1: 2.0},
        "eval/loss": {2: 1.7},
    }
    # TensorBoard alone adds the HPARAMS tab's metric, the final loss.
    assert _scalars(tmp_path / "tensorboard") == _approx({**expected, "hparams/final_loss": {2: 1.5}})
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged: dict[str, dict[int, float]] = {}
    for r in jsonl:
        for k, v in r.get("values", {}).items():
            logged.setdefault(k, {})[r["step"]] = v
    assert logged == _approx(expected)
    (wandb_run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert _wandb_history(wandb_run) == _approx(expected)
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert [s["kind"] for s in state["trackers"]] == ["tensorboard", "log", "wandb"]
    # The train/eval history beside the trackers, and its plot.
    assert (tmp_path / "history.jsonl").is_file() and (tmp_path / "plots" / "training.png").stat().st_size > 0

    # Resuming the multi run hands each tracker its own state back.
    again = build_tracker(config, tmp_path)
    TrackerSink(again, RUN, tmp_path / STATE_FILE, resume=True).close("finished")


def test_metric_names_put_loss_first_and_ranks_under_system() -> None:
    points = [
        MetricPoint(5, 0, {"loss": 1.0, "grad_norm": 2.0, "task/accuracy": 0.5}),
        MetricPoint(5, 3, {"step_time_s": 0.1, "cuda_max_allocated_bytes": 9.0}, "health"),
        MetricPoint(5, -1, {"restarts": 1.0}, "health"),
        MetricPoint(5, 0, {"loss": 1.1, "perplexity": 3.0}, "eval"),
    ]
    names = {k for p in points for k in metric_names(p)}
    assert names == {
        "train/loss",
        "train/grad_norm",
        "train/task/accuracy",
        "system/rank3/step_time_s",
        "system/rank3/cuda_max_allocated_bytes",
        "system/cluster/restarts",
        "eval/loss",
        "eval/perplexity",
    }
    # However many ranks, a UI that sorts sections by name shows exactly three.
    assert {n.split("/")[0] for n in names} == {"train", "eval", "system"}


def test_tracker_errors_name_the_kind_and_the_store(tmp_path: Path) -> None:
    class Logging(BaseModel):
        tracker: TrackerConfig

    with pytest.raises(
        ValidationError, match=r"'aim'.*expected tags: 'mlflow', 'log', 'tensorboard', 'wandb'"
    ):
        Logging.model_validate({"tracker": {"kind": "aim"}})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tensorboard").write_text("a file where the event folder should be")
    with pytest.raises(
        TrackerError, match=r"logging.tracker: tracker 'tensorboard' cannot open its store .*is a file"
    ):
        check_tracker(MultiTrackerConfig(trackers=(LogTrackerConfig(), TensorBoardTrackerConfig())), run_dir)
    (tmp_path / "blocked").write_text("")
    with pytest.raises(TrackerError, match="tracker 'log' cannot open its store"):
        check_tracker(LogTrackerConfig(jsonl="../blocked/metrics.jsonl"), run_dir)
    check_tracker(TensorBoardTrackerConfig(log_dir="tb"), tmp_path / "new-run")  # nothing exists yet: fine
    assert not (tmp_path / "new-run").exists()


def test_tracker_locations_give_the_command_that_opens_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    config = MultiTrackerConfig.model_validate(
        {"trackers": [{"kind": "mlflow"}, {"kind": "tensorboard", "log_dir": "tb"}, {"kind": "wandb"}]}
    )
    mlflow, tb, wandb = tracker_locations(config, tmp_path)
    assert mlflow.command == f"mlflow ui --backend-store-uri sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert tb.command == f"tensorboard --logdir {tmp_path.resolve() / 'tb'}"
    assert wandb.command == f"wandb sync {tmp_path.resolve() / 'wandb'}/offline-run-*"
