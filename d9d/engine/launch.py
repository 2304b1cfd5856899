"""Launchers without Ray: a single process, or one process per rank under torchrun.

    python -m d9d.engine.launch CONFIG [--set key=value ...]                 # single process
    torchrun --nproc-per-node 4 -m d9d.engine.launch CONFIG [--set ...]      # reads RANK, WORLD_SIZE, ...

`run_rank` is also the entrypoint the Ray rank actors call, so all three share every line of engine code.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from d9d.core.context import DistributedContext, init_process_group
from d9d.core.mesh_params import DeviceMeshParameters
from d9d.engine.checkpoint import CheckpointError, LocalRunReporter
from d9d.engine.config import TrainConfig, load_config, parse_config
from d9d.engine.identity import IdentityError
from d9d.engine.resume import ResumeDecision, check_resume
from d9d.engine.run_files import RunRecord, RunSummary, record_launch, tracker_lines, write_record
from d9d.engine.runtime import MetricPoint, RankResult, RankRuntime, RunReporter
from d9d.engine.tracking_sink import STATE_FILE, TrackerSink, run_files_mirror
from d9d.engine.trainer import Trainer
from d9d.tracking import LogTrackerConfig, RunSpec, build_tracker


def with_data_parallel(params: DeviceMeshParameters, data_parallel: int) -> DeviceMeshParameters:
    """The same layout with a different data-parallel degree (elastic restarts); pp, cp, tp, ep stay.

    The shard degree is kept when it divides the new degree (replicas are dropped or added), otherwise
    everything becomes sharding.
    """
    if data_parallel == params.data_parallel:
        return params
    fields = params.model_dump()
    if data_parallel % params.data_parallel_shard == 0:
        fields["data_parallel_replicate"] = data_parallel // params.data_parallel_shard
    else:
        fields["data_parallel_replicate"] = 1
        fields["data_parallel_shard"] = data_parallel
    return DeviceMeshParameters(**fields)


def run_rank(
    config: Mapping[str, Any] | TrainConfig, runtime: RankRuntime, reporter: RunReporter
) -> RankResult:
    """Run training on this rank. The default process group may already exist (Ray actors, tests)."""
    cfg = config if isinstance(config, TrainConfig) else parse_config(config)
    params = cfg.mesh
    if runtime.data_parallel_override is not None:
        params = with_data_parallel(params, runtime.data_parallel_override)
    ctx = DistributedContext.create(params)
    trainer = Trainer(cfg, ctx, reporter, attempt=runtime.attempt)
    trainer.setup()
    return trainer.train()


def run_params(config: TrainConfig) -> dict[str, Any]:
    """What a tracker records as the run's parameters: the user's hparams plus the whole config."""
    return {
        "hparams": config.run.hparams,
        "config": config.model_dump(mode="json", exclude={"run": {"hparams"}}),
    }


class LaunchRecords:
    """What rank 0 of a launcher without Ray writes for `d9d list/status/plot/logs`: `run.json` when the
    launch starts and its `run_summary.json` record when it starts and when it ends
    (d9d.engine.run_files), in the run directory and, when elsewhere, the storage root."""

    def __init__(
        self,
        config: TrainConfig,
        decision: ResumeDecision | None,
        tracker: Any,
        *,
        launcher: str | None = None,
        resumed_from: int | None = None,
    ) -> None:
        self._config = config
        launch_id = f"{int(time.time())}-{uuid.uuid4().hex[:8]}"
        root, run_dir = config.storage_root, config.run_dir
        elsewhere = not (isinstance(root, Path) and root.resolve() == run_dir.resolve())
        record = RunRecord(
            run_name=config.run.name,
            run_dir=str(run_dir),
            launch_id=launch_id,
            started_at=time.time(),
            ray_address=None,
            ray_job_id=None,
            submission_id=None,
            detach=False,
            driver=f"{socket.gethostname()}:{os.getpid()}",
            storage_root=str(root) if elsewhere else None,
            launcher=launcher or ("torchrun" if "RANK" in os.environ else "process"),
            total_steps=config.trainer.total_steps,
            trackers=tracker_lines(tracker, run_dir) if tracker is not None else (),
        )
        for where in [run_dir, root] if elsewhere else [run_dir]:
            write_record(record, where)
        resumed = decision.step if decision is not None and decision.action == "resume" else resumed_from
        self.summary = RunSummary(
            run_name=config.run.name,
            status="starting",
            steps=0,
            restarts=0,
            world_sizes=[int(os.environ.get("WORLD_SIZE", "1"))],
            resumed_from=[resumed],
            launch_id=launch_id,
        )
        record_launch(root, self.summary)

    def ended(self, result: RankResult | None, error: BaseException | None = None) -> None:
        s = self.summary
        if result is not None:
            s.status, s.steps = result.status, result.steps
            s.final_loss, s.tokens_per_s = result.final_loss, result.tokens_per_s
        else:
            s.status = "failed"
            s.error = "".join(traceback.format_exception_only(error)).strip() if error else None
        s.ended_at = time.time()
        record_launch(self._config.storage_root, s)


def recorded_train(trainer: Trainer, tracker: Any = None) -> RankResult:
    """`trainer.train()` (set up already) as a recorded launch, for a script that drives the `Trainer`
    itself: rank 0 writes `run.json` (launcher `script`) and the launch's `run_summary.json` record when
    it starts and when it ends, as `python -m d9d.engine.launch` does, so `d9d list` and `d9d status` show
    the run as running, then finished, stopped or failed (with its error). `tracker`: the tracker config
    the script writes metrics with, for the record's tracker lines."""
    config = trainer.config
    records = None
    if int(os.environ.get("RANK", "0")) == 0:
        resumed = trainer.progress.step or None  # where setup() resumed from
        records = LaunchRecords(config, None, tracker, launcher="script", resumed_from=resumed)
    return _recorded(records, trainer.train)


def _recorded(records: LaunchRecords | None, train: Callable[[], RankResult]) -> RankResult:
    """`train()`, with how it ended (its result, or the exception it raised) in `records` where this rank
    keeps them."""
    try:
        result = train()
    except BaseException as e:
        if records is not None:
            records.ended(None, e)
        raise
    if records is not None:
        records.ended(result)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m d9d.engine.launch")
    parser.add_argument("config", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides, ignore_sections=["cluster"])
    rank = int(os.environ.get("RANK", "0"))
    # Before anything touches the run directory (the tracker opens files there).
    try:
        decision = check_resume(config)
    except (CheckpointError, IdentityError) as e:
        print(f"d9d: {e}", file=sys.stderr)
        return 2
    if decision.action == "finished":
        if rank == 0:
            print(f"d9d: run {config.run.name} {decision.message}", file=sys.stderr)
        return 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ:
        # One process: a one-rank gloo group on an in-memory store, so meshes and DTensors still exist.
        store = dist.HashStore()  # type: ignore[attr-defined]  # exported by c10d, not re-declared
        init_process_group("gloo", store=store, rank=0, world_size=1)
    runtime = RankRuntime(
        rank=rank,
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        run_dir=config.run_dir,
    )
    sink = None
    records = None
    if rank == 0:
        # Default: metrics.jsonl in the run dir; the progress reporter already prints to the terminal.
        tracker_config = config.logging.tracker or LogTrackerConfig(stdout=False)
        records = LaunchRecords(config, decision, tracker_config)
        mirror = run_files_mirror(tracker_config, config.run_dir, config.storage_root)
        if mirror is not None and decision.action == "resume":
            mirror.restore()  # a run.dir on a new node continues the tracker's run from the storage root
        sink = TrackerSink(
            build_tracker(tracker_config, config.run_dir),
            RunSpec(config.run.name, run_params(config)),
            config.run_dir / STATE_FILE,
            resume=True,
            mirror=mirror,
        )
        if decision.action == "resume":
            # The resume in the tracker and the history, where `d9d plot` marks it (d9d.tracking.history).
            mark = {"resumed_from": float(decision.step), "restart": 0.0}
            sink.write([MetricPoint(decision.step + 1, -1, mark, "health", time.time())])
    reporter = LocalRunReporter(
        config.checkpoint_dir, config.checkpointing.keep_last, sink, config.checkpointing.on_damaged
    )
    result = _recorded(records, lambda: run_rank(config, runtime, reporter))
    if sink is not None:
        sink.close("finished" if result.status == "finished" else "killed")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if result.status == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
