"""`TensorBoardTracker`: scalars and histograms as TensorBoard event files (`tensorboard --logdir DIR`).

Written with the `tensorboard` package's own event-file writer, so the tracker needs no torch and works in
the coordinator process. Histograms are real TensorBoard histograms (the HISTOGRAMS tab), binned here.
The run's parameters (the whole config) go to the HPARAMS tab, one hyperparameter per dotted key, with the
final loss as its metric (`hparams/final_loss`, written when the run closes: the last `train/loss`), and
as a Markdown table to the TEXT tab (`run/params`).

Resume: a reopened run writes a new event file into the same directory; TensorBoard merges the files of a
directory into one run. Steps at or below the last step the directory already holds are dropped, so the
steps a restarted job recomputes do not appear twice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from d9d.tracking.protocol import (
    HistogramValues,
    RunSpec,
    RunStatus,
    StepFloor,
    check_resume_kind,
    flatten_params,
)

LOSS_TAG = "train/loss"
FINAL_LOSS_TAG = "hparams/final_loss"


def hparam_value(value: Any) -> bool | int | float | str:
    """What the HPARAMS tab can hold of a parameter: a bool, number or string as is, anything else as JSON."""
    if isinstance(value, bool | int | float | str):
        return value
    return json.dumps(value, default=str)


def last_logged_step(log_dir: Path) -> int | None:
    """The largest step of any scalar or histogram already in `log_dir`'s event files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    last: int | None = None
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("summary") and (last is None or event.step > last):
                last = int(event.step)
    return last


class TensorBoardTracker:
    def __init__(self, log_dir: Path, flush_secs: float = 10.0, histogram_bins: int = 64) -> None:
        self.log_dir = log_dir
        self._flush_secs = flush_secs
        self._bins = histogram_bins
        self._writer: Any = None
        self._floor = StepFloor()
        self._last_loss: tuple[int, float] | None = None  # (step, value) of the newest `train/loss`

    def open(self, run: RunSpec, resume: Mapping[str, Any] | None = None) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if self._writer is not None:
            raise RuntimeError(f"TensorBoardTracker: a run is already open in {self.log_dir}")
        if resume is not None:
            check_resume_kind(resume, "tensorboard")
            self._floor = StepFloor(last_logged_step(self.log_dir) if self.log_dir.is_dir() else None)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # The writer flushes on its own thread at most every flush_secs; the queue bounds what waits.
        self._writer = EventFileWriter(str(self.log_dir), max_queue_size=100, flush_secs=self._flush_secs)
        if resume is None:
            self._log_params(run)
            self._log_hparams(run)

    def resume_state(self) -> dict[str, Any]:
        return {"kind": "tensorboard", "log_dir": str(self.log_dir)}

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        if not self._allows(step):
            return
        summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        self._add(step, summary)
        if LOSS_TAG in values and (self._last_loss is None or step >= self._last_loss[0]):
            self._last_loss = (step, float(values[LOSS_TAG]))

    def log_histogram(self, step: int, name: str, values: HistogramValues) -> None:
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

        if not self._allows(step):
            return
        data = np.asarray(values, dtype=np.float64).reshape(-1)
        if data.size == 0:
            return
        counts, edges = np.histogram(data, bins=self._bins)
        histogram = HistogramProto(
            min=float(data.min()),
            max=float(data.max()),
            num=float(data.size),
            sum=float(data.sum()),
            sum_squares=float(np.dot(data, data)),
            bucket_limit=edges[1:].tolist(),
            bucket=counts.astype(np.float64).tolist(),
        )
        self._add(step, Summary(value=[Summary.Value(tag=name, histo=histogram)]))

    def close(self, status: RunStatus = "finished") -> None:
        if self._writer is None:
            return
        if self._last_loss is not None:  # the HPARAMS tab's metric: the loss the run ended with
            from tensorboard.compat.proto.summary_pb2 import Summary

            step, loss = self._last_loss
            self._add(step, Summary(value=[Summary.Value(tag=FINAL_LOSS_TAG, simple_value=loss)]))
        self._writer.close()  # flushes what is queued
        self._writer = None

    def _allows(self, step: int) -> bool:
        if self._writer is None:
            raise RuntimeError("TensorBoardTracker: call open() before logging")
        return self._floor.allows(step)

    def _add(self, step: int, summary: Any) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    def _log_hparams(self, run: RunSpec) -> None:
        """The run's parameters in the HPARAMS tab: the experiment (every key, the final loss and the loss
        as metrics) and this run's values. Numbers, strings and booleans as they are, anything else (lists,
        None) as its JSON text."""
        from tensorboard.plugins.hparams import summary_v2 as hp

        values = {k: hparam_value(v) for k, v in flatten_params(run.params).items()}
        values.update({f"tag.{k}": v for k, v in run.tags.items()})
        metrics = [
            hp.Metric(FINAL_LOSS_TAG, display_name="final loss"),
            hp.Metric(LOSS_TAG, display_name="loss"),
        ]
        self._add(0, hp.hparams_config_pb([hp.HParam(k) for k in values], metrics))
        self._add(0, hp.hparams_pb(values, trial_id=run.name))

    def _log_params(self, run: RunSpec) -> None:
        """The run's parameters as one markdown table in the TEXT tab."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        rows = [f"| {k} | {v} |" for k, v in flatten_params(run.params).items()]
        tags = [f"| tag.{k} | {v} |" for k, v in run.tags.items()]
        text = "\n".join([f"run **{run.name}**", "", "| key | value |", "|---|---|", *tags, *rows])
        tensor = TensorProto(
            dtype=7,  # DT_STRING
            string_val=[text.encode()],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        self._add(0, Summary(value=[Summary.Value(tag="run/params", metadata=metadata, tensor=tensor)]))
