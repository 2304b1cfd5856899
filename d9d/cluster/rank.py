"""One Ray actor per rank: rendezvous, process group, heartbeats, then the engine entrypoint.

Rendezvous is race-free: rank 0 binds a TCPStore on port 0 before any other rank runs, the coordinator
learns the real port from it and hands it to everyone else. The process group is initialized here (gloo on
CPU, NCCL with gloo alongside on GPU) so the engine's `DistributedContext.create` finds it ready and only
builds the meshes.

A rank's stdout and stderr (its own prints, logging, warnings, native libraries writing to the file
descriptors) go to `<run dir>/logs/rank<r>.log`, appended across restarts, so the driver's console shows
only the coordinator's progress; `cluster.rank_output: forward` (`d9d train --verbose`) leaves them to Ray,
which forwards them to the driver prefixed `(RankActor pid=...)`.

A rank reports how long its setup took as one health point (`SETUP_KEYS`): the process group, the build
(until the engine asks for the latest checkpoint) and the load (until rank 0's first step boundary). The
point's wall time is the end of the last of them, so the coordinator can place them on its own clock for
the recovery-phase split (`d9d.cluster.control.recovery`).

A warm standby is the same actor started ahead of time: `warm` imports the entrypoint's modules (torch, the
engine) so a restart that uses it skips the interpreter start and the imports; on a GPU job it also starts
CUDA with the devices the job's ranks on its node see (docs/cluster.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

import ray
import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported by c10d, not re-declared

from d9d.cluster.control.failure import RankError
from d9d.cluster.reporter import CoordinatorTransfer, RayRunReporter
from d9d.core import flight_recorder
from d9d.core.context import init_process_group
from d9d.engine.runtime import MetricPoint, RankResult, RankRuntime, failed_step

RANK_LOG_DIR = "logs"
# Setup durations of one rank (seconds), in order; a key is left out when its end was not seen.
SETUP_PROCESS_GROUP = "setup_process_group_s"  # run() entered -> process group ready
SETUP_BUILD = "setup_build_s"  # -> the engine asks for the latest checkpoint
SETUP_LOAD = "setup_load_s"  # -> rank 0's first step boundary (the checkpoint is loaded)
SETUP_KEYS = (SETUP_PROCESS_GROUP, SETUP_BUILD, SETUP_LOAD)
_REPORT_TIMEOUT_S = 5.0  # a failing rank's wait for the coordinator to take its error
_log = logging.getLogger(__name__)


def rank_log_path(run_dir: Path, rank: int) -> Path:
    return run_dir / RANK_LOG_DIR / f"rank{rank}.log"


@contextlib.contextmanager
def output_to_file(path: Path, header: str) -> Iterator[None]:
    """Point this process's stdout and stderr file descriptors at `path` (appending) until the block ends.

    At the descriptor level, not by swapping `sys.stdout`, so output of C++ (NCCL, gloo), of child processes
    and of handlers that captured `sys.stderr` earlier lands in the file too.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    try:
        with path.open("a") as log:
            log.write(f"{header}\n")
            log.flush()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])


@dataclass(frozen=True)
class RankNode:
    node_id: str
    ip: str
    gpu_ids: tuple[str, ...]  # what Ray assigned to this actor
    pid: int = 0


def rank_stacks_path(run_dir: Path, rank: int) -> Path:
    """Where a rank's `faulthandler` writes its threads' stacks on STACKS_SIGNAL (appended)."""
    return run_dir / RANK_LOG_DIR / f"rank{rank}.stacks"


STACKS_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class RankLaunch:
    """Everything a rank needs to join the job; built by the coordinator per attempt."""

    entrypoint: str
    config: dict[str, Any]
    runtime: RankRuntime
    master_addr: str
    master_port: int
    local_world_size: int
    backend: Literal["gloo", "nccl"]
    # GPU ranks on one node see all of that node's job GPUs (NCCL needs its peers for P2P/NVLink);
    # the rank drives the one Ray assigned to it, at index `runtime.local_rank`.
    cuda_visible_devices: str | None
    init_timeout_s: float
    heartbeat_interval_s: float
    command_seq: int
    transfer: CoordinatorTransfer | None
    # "files": stdout/stderr to <run dir>/logs/rank<r>.log; "forward": left to Ray (to the driver).
    rank_output: Literal["files", "forward"] = "files"
    storage_stall_s: float = 10.0  # cluster.storage_stall_s


@dataclass(frozen=True)
class StandbyReady:
    """What a warm standby says once its imports are done."""

    pid: int
    node_id: str
    ready_at: float  # wall clock
    # GPU jobs: the CUDA_VISIBLE_DEVICES its CUDA runtime started with (fixed from then on); None on CPU.
    cuda_visible_devices: str | None = None


class PhasedReporter(RayRunReporter):
    """The rank's reporter, which also notes when the engine ends its build (asks for the latest
    checkpoint) and its load (rank 0's first step boundary) and reports the setup point once.

    Rank 0 reports at its first step boundary; the other ranks, which never see a boundary, when their
    first `latest_checkpoint` returns (without a load duration)."""

    def __init__(
        self, launch: RankLaunch, coordinator: Any, *, run_at: float, process_group_at: float
    ) -> None:
        rt = launch.runtime
        super().__init__(
            coordinator,
            rt.attempt,
            rt.rank,
            launch.command_seq,
            launch.transfer,
            heartbeat_interval_s=launch.heartbeat_interval_s,
            storage_stall_s=launch.storage_stall_s,
        )
        self._setup_rank = rt.rank
        self._setup_attempt = rt.attempt
        self._run_at = run_at
        self._pg_at = process_group_at
        self._built_at: float | None = None
        self._reported = False
        self._mark("process_group", process_group_at)

    def _mark(self, phase: str, at: float) -> None:
        """Rank 0 tells the coordinator a start-up phase ended (`d9d train`'s console shows it now)."""
        if self._setup_rank == 0:
            with contextlib.suppress(Exception):  # the coordinator's business; never the rank's failure
                self._coordinator.setup_mark.remote(self._setup_attempt, phase, at)

    def latest_checkpoint(self) -> Path | None:
        if self._built_at is None:
            self._built_at = time.time()
            self._mark("build", self._built_at)
        path = super().latest_checkpoint()
        if self._setup_rank != 0:
            self._report_setup(self._built_at, loaded_at=None)
        return path

    def commands(self, step: int) -> Any:
        if not self._reported:
            loaded_at = time.time()
            self._mark("load", loaded_at)
            self._report_setup(self._built_at, loaded_at=loaded_at, step=step)
        return super().commands(step)

    def _report_setup(self, built_at: float | None, loaded_at: float | None, step: int = 0) -> None:
        if self._reported:
            return
        self._reported = True
        values = {SETUP_PROCESS_GROUP: self._pg_at - self._run_at}
        if built_at is not None:
            values[SETUP_BUILD] = built_at - self._pg_at
            if loaded_at is not None:
                values[SETUP_LOAD] = loaded_at - built_at
        elif loaded_at is not None:  # the engine never asked for a checkpoint: all of it was its build
            values[SETUP_BUILD] = loaded_at - self._pg_at
        end = self._pg_at + sum(v for k, v in values.items() if k != SETUP_PROCESS_GROUP)
        self.metrics(MetricPoint(step, self._setup_rank, values, "health", end))


def is_setup_point(point: MetricPoint) -> bool:
    """A rank's setup point (`PhasedReporter`): one per rank and attempt."""
    return point.kind == "health" and point.rank >= 0 and SETUP_PROCESS_GROUP in point.values


def setup_marks(point: MetricPoint) -> tuple[float, float, float | None, float | None] | None:
    """(run entered, process group ready, build done, load done) in wall-clock seconds from a rank's setup
    point; None for any other point."""
    if not is_setup_point(point):
        return None
    durations = [point.values.get(k) for k in SETUP_KEYS]
    known = [d for d in durations if d is not None]
    marks: list[float | None] = []
    at = point.wall_time - sum(known)
    run_at = at
    for d in durations:
        if d is None:
            marks.append(None)
            continue
        at += d
        marks.append(at)
    pg_at = marks[0]
    assert pg_at is not None
    return run_at, pg_at, marks[1], marks[2]


def resolve_entrypoint(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class RankActor:
    def __init__(self, coordinator: Any) -> None:
        self._coordinator = coordinator
        self._warm: StandbyReady | None = None
        self._store: TCPStore | None = None
        self._stacks_file: TextIO | None = None
        # Ray starts workers at nice 15 (RAY_worker_niceness) so its own daemons stay responsive; a rank is
        # the job's critical path and should not lose its core to every other process on the node. Going
        # back to 0 needs CAP_SYS_NICE (root in most containers); without it the rank keeps Ray's value.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)

    def warm(
        self, entrypoint: str, cuda_visible_devices: str | None = None, preload: tuple[str, ...] = ()
    ) -> StandbyReady:
        """Standby: import what a rank would import first (the entrypoint's module pulls in torch and the
        engine, `preload` what it imports later, such as the compiler), then wait for `run`.

        With `cuda_visible_devices` (a GPU job: the devices the job's ranks on this node see) CUDA starts
        now, and with a single device its context is created too. Those devices are fixed for the
        process's life, so the standby can only become a rank whose launch names the same set
        (`WorkerGroup.start` checks). With several, the context waits for the rank's own device: a context
        on the wrong one would hold memory there for good.
        """
        if self._warm is None:
            resolve_entrypoint(entrypoint)
            for module in preload:
                importlib.import_module(module)
            if cuda_visible_devices is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
                torch.cuda.init()
                if torch.cuda.device_count() == 1:
                    torch.zeros(1, device="cuda:0")  # the context and the caching allocator
            self._warm = StandbyReady(
                os.getpid(), ray.get_runtime_context().get_node_id(), time.time(), cuda_visible_devices
            )
        return self._warm

    def node(self) -> RankNode:
        ctx = ray.get_runtime_context()
        return RankNode(
            node_id=ctx.get_node_id(),
            ip=ray.util.get_node_ip_address(),
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
            pid=os.getpid(),
        )

    def open_store(self, world_size: int, timeout_s: float) -> int:
        """Rank 0: bind the rendezvous store on a free port and return it."""
        self._store = TCPStore(
            ray.util.get_node_ip_address(),
            0,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        port: int = self._store.port
        return port

    def run(self, launch: RankLaunch) -> RankResult:
        rt = launch.runtime
        if launch.rank_output == "forward":
            return self._run(launch)
        header = f"---- d9d rank {rt.rank} of {rt.world_size}, attempt {rt.attempt}, pid {os.getpid()} ----"
        with output_to_file(rank_log_path(rt.run_dir, rt.rank), header):
            return self._run(launch)

    def _run(self, launch: RankLaunch) -> RankResult:
        run_at = time.time()
        rt = launch.runtime
        self._dump_stacks_on_signal(rank_stacks_path(rt.run_dir, rt.rank))
        self._serve_collectives()
        os.environ.update(
            RANK=str(rt.rank),
            WORLD_SIZE=str(rt.world_size),
            LOCAL_RANK=str(rt.local_rank),
            LOCAL_WORLD_SIZE=str(launch.local_world_size),
            MASTER_ADDR=launch.master_addr,
            MASTER_PORT=str(launch.master_port),
        )
        if launch.cuda_visible_devices is not None:
            warm = self._warm.cuda_visible_devices if self._warm is not None else None
            if warm is not None and warm != launch.cuda_visible_devices:
                raise RuntimeError(  # WorkerGroup.start never launches a standby so; CUDA cannot switch
                    f"this standby's CUDA started with devices {warm}, the launch needs "
                    f"{launch.cuda_visible_devices}"
                )
            os.environ["CUDA_VISIBLE_DEVICES"] = launch.cuda_visible_devices
        reporter: RayRunReporter | None = None
        try:
            self._init_process_group(launch)
            reporter = PhasedReporter(
                launch, self._coordinator, run_at=run_at, process_group_at=time.time()
            ).start()
            entrypoint = resolve_entrypoint(launch.entrypoint)
            result: RankResult = entrypoint(launch.config, rt, reporter)
            return result
        except Exception as e:
            # Before the process group goes: tearing it down breaks the peers' collectives, and their errors
            # must reach the coordinator after this one, the cause.
            self._report_failure(launch, e)
            raise
        finally:
            if reporter is not None:
                reporter.close()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _dump_stacks_on_signal(self, path: Path) -> None:
        """On STACKS_SIGNAL, `faulthandler` writes every thread's stack to `path` from its C signal handler:
        it works while the training thread is stuck in C code (a collective) or holds the GIL. The
        coordinator sends the signal when it declares the attempt hung (`WorkerGroup.dump_stacks`)."""
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            path.parent.mkdir(parents=True, exist_ok=True)
            if self._stacks_file is None or self._stacks_file.name != str(path):
                self._stacks_file = path.open("a")
            faulthandler.register(STACKS_SIGNAL, file=self._stacks_file, all_threads=True, chain=False)

    def _serve_collectives(self) -> None:
        """Answer the node's hang dump with this rank's last collectives (`d9d.core.flight_recorder.serve`:
        a daemon thread on a local socket, which answers while the training thread waits in a collective).
        A rank that cannot serve them still trains; its hang report says it gave no flight record."""
        try:
            flight_recorder.serve()
        except OSError as e:
            _log.warning("cannot serve the flight recorder's collectives: %s", e)

    def _report_failure(self, launch: RankLaunch, error: Exception) -> None:
        """Tell the coordinator this rank's own exception (and write it to the rank's log), waiting briefly
        for the call: the coordinator then blames this error, not what it causes on the other ranks."""
        rt = launch.runtime
        traceback.print_exc()
        sys.stderr.flush()
        failure = RankError.of(rt.rank, error, step=failed_step(error))
        if launch.rank_output == "files":
            failure = dataclasses.replace(failure, log=str(rank_log_path(rt.run_dir, rt.rank)))
        try:
            ray.get(self._coordinator.rank_failed.remote(rt.attempt, failure), timeout=_REPORT_TIMEOUT_S)
        except Exception:  # the coordinator is gone or busy: the failed `run` call still says it
            _log.warning("could not report the failure to the coordinator", exc_info=True)

    def _init_process_group(self, launch: RankLaunch) -> None:
        rt = launch.runtime
        timeout = datetime.timedelta(seconds=launch.init_timeout_s)
        store = self._store
        if store is None:
            store = TCPStore(
                launch.master_addr, launch.master_port, rt.world_size, is_master=False, timeout=timeout
            )
        device = torch.device("cuda", rt.local_rank) if launch.backend == "nccl" else None
        init_process_group(
            launch.backend,
            device=device,
            store=store,
            rank=rt.rank,
            world_size=rt.world_size,
            timeout=timeout,
        )
