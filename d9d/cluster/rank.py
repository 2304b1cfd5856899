"""One Ray actor per rank: rendezvous, process group, heartbeats, then the engine entrypoint.

Rendezvous is race-free: rank 0 binds a TCPStore on port 0 before any other rank runs, the coordinator
learns the real port from it and hands it to everyone else. The process group is initialized here (gloo on
CPU, NCCL with gloo alongside on GPU) so the engine's `DistributedContext.create` finds it ready and only
builds the meshes.

A rank's stdout and stderr (its own prints, logging, warnings, native libraries writing to the file
descriptors) go to `<run dir>/logs/rank<r>.log`, appended across restarts, so the driver's console shows
only the coordinator's progress; `cluster.rank_output: forward` (`d9d train --verbose`) leaves them to Ray,
which forwards them to the driver prefixed `(RankActor pid=...)`.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ray
import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported by c10d, not re-declared

from d9d.cluster.reporter import CoordinatorTransfer, RayRunReporter
from d9d.core.context import init_process_group
from d9d.engine.runtime import RankResult, RankRuntime

RANK_LOG_DIR = "logs"


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


def resolve_entrypoint(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class RankActor:
    def __init__(self, coordinator: Any) -> None:
        self._coordinator = coordinator
        self._store: TCPStore | None = None
        # Ray starts workers at nice 15 (RAY_worker_niceness) so its own daemons stay responsive; a rank is
        # the job's critical path and should not lose its core to every other process on the node. Going
        # back to 0 needs CAP_SYS_NICE (root in most containers); without it the rank keeps Ray's value.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)

    def node(self) -> RankNode:
        ctx = ray.get_runtime_context()
        return RankNode(
            node_id=ctx.get_node_id(),
            ip=ray.util.get_node_ip_address(),
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
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
        rt = launch.runtime
        os.environ.update(
            RANK=str(rt.rank),
            WORLD_SIZE=str(rt.world_size),
            LOCAL_RANK=str(rt.local_rank),
            LOCAL_WORLD_SIZE=str(launch.local_world_size),
            MASTER_ADDR=launch.master_addr,
            MASTER_PORT=str(launch.master_port),
        )
        if launch.cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = launch.cuda_visible_devices
        self._init_process_group(launch)
        reporter = RayRunReporter(
            self._coordinator,
            rt.attempt,
            rt.rank,
            launch.command_seq,
            launch.transfer,
            heartbeat_interval_s=launch.heartbeat_interval_s,
        ).start()
        try:
            entrypoint = resolve_entrypoint(launch.entrypoint)
            result: RankResult = entrypoint(launch.config, rt, reporter)
            return result
        finally:
            reporter.close()
            if dist.is_initialized():
                dist.destroy_process_group()

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
