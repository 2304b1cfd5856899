"""Launchers without Ray: a single process, or one process per rank under torchrun.

    python -m d9d.engine.launch CONFIG [--set key=value ...]                 # single process
    torchrun --nproc-per-node 4 -m d9d.engine.launch CONFIG [--set ...]      # reads RANK, WORLD_SIZE, ...

`run_rank` is also the entrypoint the Ray rank actors call, so all three share every line of engine code.

SIGTERM or SIGINT to a process of these launchers (`d9d stop`, a scheduler's preemption, torchrun shutting
its workers down, Ctrl-C) stops the run at the next step boundary, as a STOP command does under Ray: rank 0
turns the signal into that command, which every rank applies at the same boundary, where the step is saved
and committed; the launch records `stopped` (`stop_reason`: the signal's name) and the process exits with 0.
A second signal does what it did before: SIGTERM ends the process at once, SIGINT raises KeyboardInterrupt
(the launch records `failed`: interrupted before the step boundary). Ranks other than 0 stop with rank 0:
only its signal stops the run. Under torchrun, Ctrl-C reaches only the agent (torch starts each worker in a
session of its own), which passes SIGINT on to every worker once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from d9d.core.context import DistributedContext, init_process_group
from d9d.core.cpu_affinity import apply_cpu_affinity
from d9d.core.mesh_params import DeviceMeshParameters
from d9d.core.storage import Location
from d9d.engine.checkpoint import CheckpointError, LocalRunReporter
from d9d.engine.commands import broadcast_commands
from d9d.engine.config import TrainConfig, load_config, parse_config
from d9d.engine.identity import IdentityError
from d9d.engine.resume import ResumeDecision, check_resume
from d9d.engine.run_files import RunRecord, RunSummary, record_launch, tracker_lines, write_record
from d9d.engine.runtime import (
    Command,
    CommandKind,
    MetricPoint,
    RankCheckpointReport,
    RankResult,
    RankRuntime,
    RunReporter,
)
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
    apply_cpu_affinity(
        cfg.cpu_affinity,
        ctx.device,
        local_rank=ctx.local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        log=ctx.logger,
    )
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

    def ended(
        self, result: RankResult | None, error: str | None = None, stop_reason: str | None = None
    ) -> None:
        """How the launch ended: its `result`, or the `error` line (`SignalStop.failure`) it failed with."""
        s = self.summary
        if result is not None:
            s.status, s.steps = result.status, result.steps
            s.final_loss, s.tokens_per_s = result.final_loss, result.tokens_per_s
            s.stop_reason = stop_reason if result.status == "stopped" else None
        else:
            s.status = "failed"
            s.error = error
        s.ended_at = time.time()
        record_launch(self._config.storage_root, s)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what `stop_on_signals` turns into a stop


def _does(handler: Any) -> str:
    """What a signal does with `handler`, for the message of the first one."""
    if handler is signal.SIG_DFL:
        return "ends the process at once"
    if handler is signal.default_int_handler:
        return "interrupts the training at once"
    return "goes to the handler it had before"


class SignalStop:
    """SIGTERM or SIGINT (Ctrl-C), while installed (`stop_on_signals`), asks for a stop at the next step
    boundary: the reporter `wrap` returns adds a STOP command to what rank 0 reads there
    (`broadcast_commands` hands it to every rank, so all stop at the same step, which the engine saves and
    commits). The first signal puts the handlers before it back (`previous`), so a second one does what it
    did before when a step never reaches its boundary: by default, SIGTERM ends the process at once and
    SIGINT raises KeyboardInterrupt. `reason`: the name of the signal that asked for the stop."""

    def __init__(self, rank: int, previous: Mapping[signal.Signals, Any] | None = None) -> None:
        self.rank = rank
        self.previous = dict(previous or {})
        self.reason: str | None = None
        self._sent = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        received = signal.Signals(signum)
        self.reason = received.name
        self.restore()
        said = (
            "stopping at the next step boundary, which is saved and committed"
            if self.rank == 0
            else "this rank stops when rank 0 does, whose signal stops the run"
        )
        second = f"a second {received.name} {_does(self.previous[received])}"
        # os.write: a print here could interrupt a print of the main thread (a reentrant call raises).
        os.write(2, f"d9d: {received.name}: {said}; {second}\n".encode())

    def restore(self) -> None:
        """The handlers before this one, back."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def pending(self) -> Sequence[Command]:
        """The STOP command, once, after the signal came."""
        if self.reason is None or self._sent:
            return ()
        self._sent = True
        return (Command(CommandKind.STOP, {"reason": self.reason}),)

    def failure(self, error: BaseException) -> str:
        """The `error` a launch that raised `error` records: a KeyboardInterrupt after a signal asked for a
        stop is a second signal that came before the step boundary."""
        line = "".join(traceback.format_exception_only(error)).strip()
        if not isinstance(error, KeyboardInterrupt) or self.reason is None:
            return line
        second = "a second SIGINT" if self.reason == "SIGINT" else f"SIGINT after {self.reason}"
        return f"KeyboardInterrupt: interrupted by {second} before the step boundary"

    def wrap(self, reporter: RunReporter) -> RunReporter:
        return _StoppingReporter(reporter, self)


class _StoppingReporter:
    """`reporter`, with the signal's STOP among its commands."""

    def __init__(self, reporter: RunReporter, stop: SignalStop) -> None:
        self._reporter = reporter
        self._stop = stop

    def metrics(self, point: MetricPoint) -> None:
        self._reporter.metrics(point)

    def commands(self, step: int) -> Sequence[Command]:
        return [*self._reporter.commands(step), *self._stop.pending()]

    def checkpoint_written(self, report: RankCheckpointReport) -> None:
        self._reporter.checkpoint_written(report)

    def commit_checkpoint(self, step: int, reports: Sequence[RankCheckpointReport]) -> None:
        self._reporter.commit_checkpoint(step, reports)

    def latest_checkpoint(self) -> Location | None:
        return self._reporter.latest_checkpoint()


@contextlib.contextmanager
def stop_on_signals(rank: int) -> Iterator[SignalStop]:
    """SIGTERM and SIGINT stop at a step boundary while the block runs (`SignalStop`); the handlers before
    it are put back after. A signal ignored when the block starts stays ignored (a shell starts a job in
    the background with SIGINT ignored, so that Ctrl-C reaches only the foreground one). Python runs signal
    handlers on the main thread only, and only from there can one be installed: elsewhere (a script
    training in a thread) the signals keep their handlers and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield SignalStop(rank)
        return
    # None: a handler not installed from Python, which cannot be put back by signal.signal.
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    handlers = {s: signal.SIG_DFL if h is None else h for s, h in previous.items() if h is not signal.SIG_IGN}
    stop = SignalStop(rank, handlers)
    for signum in stop.previous:
        signal.signal(signum, stop.handle)
    try:
        yield stop
    finally:
        stop.restore()


def recorded_train(trainer: Trainer, tracker: Any = None) -> RankResult:
    """`trainer.train()` (set up already) as a recorded launch, for a script that drives the `Trainer`
    itself: rank 0 writes `run.json` (launcher `script`) and the launch's `run_summary.json` record when
    it starts and when it ends, as `python -m d9d.engine.launch` does, so `d9d list` and `d9d status` show
    the run as running, then finished, stopped or failed (with its error). `tracker`: the tracker config
    the script writes metrics with, for the record's tracker lines. Meanwhile SIGTERM (`d9d stop`) or
    SIGINT (Ctrl-C) stops the training at the next step boundary, which is saved (module docstring)."""
    config = trainer.config
    records = None
    rank = int(os.environ.get("RANK", "0"))
    # Before the start is recorded: a run `d9d list` shows as running stops on `d9d stop`'s SIGTERM.
    with stop_on_signals(rank) as stop:
        if rank == 0:
            resumed = trainer.progress.step or None  # where setup() resumed from
            records = LaunchRecords(config, None, tracker, launcher="script", resumed_from=resumed)
        # The trainer reads its commands through the reporter it was built with: its command handler
        # reads them through the wrapped one instead, for this training only.
        handler = trainer.commands
        receive = handler.receive
        reporter = stop.wrap(trainer.reporter)
        handler.receive = lambda: broadcast_commands(reporter, trainer.ctx, trainer.progress.step)
        try:
            return _recorded(records, trainer.train, stop)
        finally:
            handler.receive = receive


def _recorded(records: LaunchRecords | None, train: Callable[[], RankResult], stop: SignalStop) -> RankResult:
    """`train()`, with how it ended (its result, or the exception it raised) in `records` where this rank
    keeps them; a stop on a signal names it (`stop_reason`), and so does an interruption by a second one."""
    try:
        result = train()
    except BaseException as e:
        if records is not None:
            records.ended(None, stop.failure(e))
        raise
    if records is not None:
        records.ended(result, stop_reason=stop.reason)
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
    with stop_on_signals(rank) as stop:  # before the launch is recorded (`recorded_train` says why)
        return _launch(config, decision, rank, stop)


def _launch(config: TrainConfig, decision: ResumeDecision, rank: int, stop: SignalStop) -> int:
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
    reporter = stop.wrap(
        LocalRunReporter(
            config.checkpoint_dir, config.checkpointing.keep_last, sink, config.checkpointing.on_damaged
        )
    )
    result = _recorded(records, lambda: run_rank(config, runtime, reporter), stop)
    if sink is not None:
        sink.close("finished" if result.status == "finished" else "killed")
    if dist.is_initialized():
        dist.destroy_process_group()
    # A stop is what was asked for (its step is committed): 0, as `d9d train` exits after `d9d stop`, and
    # torchrun ends its other workers in peace instead of reporting a failed one.
    return 0 if result.status in ("finished", "stopped") else 1


if __name__ == "__main__":
    sys.exit(main())
