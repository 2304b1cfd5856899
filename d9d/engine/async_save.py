"""Asynchronous checkpoint saves: stage on the step thread, write and hash in the background, commit later.

One save, on every rank:

1. **Stage** (the step thread; the only stall): `Checkpointer.begin` checks the step may be written (a
   collective), the model and optimizer state is copied into reusable host buffers (`HostStager`), and the
   engine/rank state is serialized. On CUDA the buffers are pinned and the copies are asynchronous
   device-to-host copies on the current stream: the next step's kernels are queued behind them, so the
   copies see this step's state, and the writer thread waits for them on a CUDA event before reading.
2. **Write** (a background thread): DCP writes the host copy through the `HashingWriter` (every byte hashed
   on its way to disk, nothing read back), then the engine's own files. DCP's collectives (plan exchange,
   write results) run on a gloo group of their own, so they never interleave with the step thread's
   collectives on the default group.
3. **Commit** (the step thread, a collective on every rank at the same point): at the first step boundary
   at which every rank's write has finished — while a save is in flight the ranks agree on that with one
   small all-reduce per step — and in any case before the next save starts (at most one save is in
   flight), before a save requested by a command returns, when the run pauses, and at the end of
   training (`Trainer` calls `poll`/`wait` at those points, on every rank alike). Then the usual
   protocol runs unchanged: `checkpoint_written` on every rank, gather, rank 0's `commit_checkpoint`.

A write that fails (or a process that dies while writing) leaves its step without a manifest: the previous
commit stays `latest`. A failure is raised on every rank at the next agreement point, naming the rank.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from d9d.core.context import DistributedContext
from d9d.core.storage import Location
from d9d.engine.checkpoint import Checkpointer, CheckpointError, StageOptimizers
from d9d.engine.runtime import MetricPoint, RankCheckpointReport


def resolve_async(requested: bool | None, device: torch.device) -> bool:
    """`checkpointing.async`: None means on for CUDA training, off on CPU (nothing to overlap with there
    but the CPU itself)."""
    return device.type == "cuda" if requested is None else requested


class HostStager:
    """Copies a state dict into host buffers that are reused from one save to the next.

    Buffers are keyed by their path in the state dict and replaced only when a tensor's shape or dtype
    changes. With `pin_memory` (the state is on CUDA) they are page-locked and the copies do not block the
    host; the caller must order reads of the result after the copies (a CUDA event).
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def buffers(self) -> Mapping[str, torch.Tensor]:
        return self._buffers

    def reserve(self, state: Mapping[str, Any]) -> None:
        """Allocate the buffers `state` needs without copying: pinning gigabytes takes seconds, better spent
        once at start-up than in the first checkpoint step."""
        self._walk(state, copy_values=False)

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return self._walk(state, copy_values=True)

    def _walk(self, state: Mapping[str, Any], copy_values: bool) -> dict[str, Any]:
        used: set[str] = set()
        staged = {str(k): self._stage(v, str(k), used, copy_values) for k, v in state.items()}
        for stale in set(self._buffers) - used:
            del self._buffers[stale]  # state that is gone (e.g. a parameter group was removed)
        return staged

    def _stage(self, value: Any, path: str, used: set[str], copy_values: bool) -> Any:
        if isinstance(value, DTensor):
            local = self._copy(value.to_local(), path, used, copy_values)
            # The same sharding on a host-memory local shard: DCP plans and writes it like the original.
            return DTensor(local, value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor):
            return self._copy(value, path, used, copy_values)
        if isinstance(value, Mapping):
            return {k: self._stage(v, f"{path}.{k}", used, copy_values) for k, v in value.items()}
        if isinstance(value, list):
            return [self._stage(v, f"{path}.{i}", used, copy_values) for i, v in enumerate(value)]
        return copy.deepcopy(value)  # hyper-parameters and the like: snapshotted as they are now

    def _copy(self, tensor: torch.Tensor, path: str, used: set[str], copy_values: bool) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin_memory)
            self._buffers[path] = buffer
        used.add(path)
        if copy_values:
            buffer.copy_(tensor.detach(), non_blocking=self.pin_memory)
        return buffer


@dataclass
class _InFlight:
    step: int
    step_dir: Location
    stall_s: float
    done: threading.Event
    report: RankCheckpointReport | None = None
    error: BaseException | None = None
    write_s: float = 0.0


OnCommit = Callable[[int, Location], None]
# How often waiting ranks compare notes (one tiny all-reduce each time).
_WAIT_POLL_S = 0.05


class AsyncSaver:
    """Saves through a `Checkpointer` with the write in the background (module docstring: the protocol).

    `on_commit(step, step_dir)` runs on every rank once a step is committed.
    """

    def __init__(self, checkpointer: Checkpointer, ctx: DistributedContext, on_commit: OnCommit) -> None:
        self.checkpointer = checkpointer
        self.ctx = ctx
        self.on_commit = on_commit
        self.stager = HostStager(pin_memory=ctx.device.type == "cuda")
        # Created by every rank at the same point (the trainer's setup), as new_group requires.
        self.group = dist.new_group(backend="gloo") if ctx.is_distributed else None
        self._flight: _InFlight | None = None

    @property
    def in_flight(self) -> int | None:
        """The step being written in the background, if any."""
        return None if self._flight is None else self._flight.step

    def reserve(self, stages: StageOptimizers) -> None:
        """Allocate the host buffers now (after the first step, when the optimizer state exists)."""
        start = time.perf_counter()
        self.stager.reserve(self.checkpointer.app_state(stages))
        nbytes = sum(b.numel() * b.element_size() for b in self.stager.buffers.values())
        self.ctx.logger.info(
            "checkpoint staging: %.2f GiB of %s host memory reserved in %.2f s",
            nbytes / 2**30,
            "pinned" if self.stager.pin_memory else "pageable",
            time.perf_counter() - start,
        )

    def save(
        self,
        step: int,
        stages: StageOptimizers,
        engine_state: Mapping[str, Any],
        rank_state: Mapping[str, Any],
    ) -> float:
        """Stage `step` and start writing it; returns the stall (seconds), which includes waiting for and
        committing a save still in flight (reported on its own as well)."""
        start = time.perf_counter()
        waited = self._flight is not None
        self.wait()
        wait_s = time.perf_counter() - start
        step_dir = self.checkpointer.begin(step)
        staged = self.stager.stage(self.checkpointer.app_state(stages))
        own = self.checkpointer.own_files(engine_state, rank_state)
        ready: torch.cuda.Event | None = None
        if self.stager.pin_memory:
            ready = torch.cuda.Event()
            ready.record()
        flight = _InFlight(step, step_dir, 0.0, threading.Event())
        # A daemon thread: a rank that fails while a write is in flight must still be able to exit (the
        # step is then left uncommitted, which is what a crash means).
        thread = threading.Thread(
            target=self._write,
            args=(flight, staged, own, ready),
            name=f"d9d-checkpoint-{step}",
            daemon=True,
        )
        flight.stall_s = time.perf_counter() - start
        self._flight = flight
        thread.start()
        values = {STALL_METRIC: flight.stall_s, **({WAIT_METRIC: wait_s} if waited else {})}
        report_metrics(self.ctx, self.checkpointer, step, values)
        return flight.stall_s

    def _write(
        self,
        flight: _InFlight,
        staged: dict[str, Any],
        own: dict[str, bytes],
        ready: torch.cuda.Event | None,
    ) -> None:
        start = time.perf_counter()
        try:
            if ready is not None:
                ready.synchronize()
            flight.report = self.checkpointer.write(flight.step, flight.step_dir, staged, own, self.group)
        except BaseException as e:  # reported on the step thread, at the next agreement point
            flight.error = e
        finally:
            flight.write_s = time.perf_counter() - start
            flight.done.set()

    def poll(self) -> None:
        """At a step boundary (every rank): commit the save in flight if every rank finished writing it."""
        if self._flight is not None and self._agree():
            self._commit()

    def wait(self) -> None:
        """Every rank: wait for the save in flight, if any, and commit it.

        The ranks keep agreeing while they wait: a rank whose write failed before DCP's collectives would
        leave the others' writers waiting in them forever, so a failure anywhere ends every rank's wait."""
        flight = self._flight
        if flight is None:
            return
        while True:
            flight.done.wait(timeout=_WAIT_POLL_S)
            if self._agree():
                break
        self._commit()

    def _agree(self) -> bool:
        """True when every rank's write has finished; raises on every rank when one of them failed."""
        flight = self._flight
        assert flight is not None
        status = torch.zeros(1 + self.ctx.world_size, dtype=torch.int32)
        status[0] = 0 if flight.done.is_set() else 1
        status[1 + self.ctx.rank] = 1 if flight.error is not None else 0
        if self.ctx.is_distributed:
            # The default group's device: NCCL reduces CUDA tensors only.
            on_device = status.to(self.ctx.device)
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
            status = on_device.cpu()
        failed = [rank for rank in range(self.ctx.world_size) if int(status[1 + rank])]
        if failed:
            self._flight = None
            where = f"{flight.step_dir} was not committed (the previous commit stays latest)"
            if flight.error is not None:
                raise CheckpointError(f"writing {where}: {flight.error}") from flight.error
            raise CheckpointError(f"rank(s) {failed} failed writing their part of {where}")
        return int(status[0]) == 0

    def _commit(self) -> None:
        flight = self._flight
        assert flight is not None and flight.report is not None
        self._flight = None
        start = time.perf_counter()
        path = self.checkpointer.commit(flight.report)
        commit_s = time.perf_counter() - start
        self.ctx.logger.info(
            "checkpoint step %d committed: the step stalled %.3f s, the background write took %.3f s, "
            "the commit %.3f s",
            flight.step,
            flight.stall_s,
            flight.write_s,
            commit_s,
        )
        values = {WRITE_METRIC: flight.write_s, COMMIT_METRIC: commit_s}
        report_metrics(self.ctx, self.checkpointer, flight.step, values)
        self.on_commit(flight.step, path)


STALL_METRIC = "checkpoint/stall_s"
WRITE_METRIC = "checkpoint/write_s"
# Step-thread time outside staging: waiting for the previous save (only when one was still in flight) and
# the commit protocol at the boundary that commits.
WAIT_METRIC = "checkpoint/wait_s"
COMMIT_METRIC = "checkpoint/commit_s"


def report_metrics(
    ctx: DistributedContext, checkpointer: Checkpointer, step: int, values: dict[str, float]
) -> None:
    """This rank's checkpoint timings, as a health point of the saved step (`system/rank<r>/checkpoint/…`
    in a tracker): train points carry the step's loss and learning rate, which consumers rely on."""
    checkpointer.reporter.metrics(MetricPoint(step, ctx.rank, values, "health", time.time()))
