"""`AsyncMetricCollector`: sync and compute metrics off the training step's critical path.

`schedule(step)` snapshots the live metric (a device-side copy, no host sync), optionally resets it, and
hands the snapshot to one worker thread that syncs it over a private process group and computes it. The
step goes on at once; `results()` later returns whatever has finished, oldest first.

Why a thread and a private group: syncing "cat" states needs a blocking shape exchange, and computing a
value needs the host to see it; on a thread neither blocks the step. Collectives issued from two threads
on one process group could pair up in different orders on different ranks, so the collector copies the
group it is given and is the only user of that copy; one worker keeps its own collectives in schedule
order. On CUDA the worker runs on a side stream that first waits for the snapshot to be ready.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Generic, Self, TypeVar

import torch
import torch.distributed as dist

from d9d.core import tree_to
from d9d.metrics.base import Metric
from d9d.metrics.sync import group_world_size

T = TypeVar("T")


def _private_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if group_world_size(group) == 1:
        return None
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)  # type: ignore[arg-type]
    private: dist.ProcessGroup = dist.new_group(ranks=ranks, use_local_synchronization=True)
    return private


class AsyncMetricCollector(Generic[T]):
    """Overlaps the sync + compute of `metric` with training.

    Construction is collective over the ranks of `group` (default: the world), and so is `schedule`:
    every member must schedule the same steps in the same order, with metrics of the same structure.
    Without torch.distributed (or on a group of one) it only computes. Results hold CPU tensors.
    """

    def __init__(self, metric: Metric[T], group: dist.ProcessGroup | None = None) -> None:
        self._metric = metric
        self._group = _private_group(group)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="d9d-metric-sync")
        self._pending: deque[tuple[int, Future[T]]] = deque()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def metric(self) -> Metric[T]:
        return self._metric

    def schedule(self, step: int, *, reset: bool = False) -> None:
        """Start syncing a snapshot of the metric labelled `step`; `reset` clears the live metric for the
        next window (per-window averages) instead of accumulating on (running totals)."""
        snapshot = self._metric.clone()
        if reset:
            self._metric.reset()
        ready: torch.cuda.Event | None = None
        if snapshot.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(snapshot.device))
        self._pending.append((step, self._executor.submit(self._sync_compute, snapshot, ready)))

    def results(self, *, wait: bool = False) -> list[tuple[int, T]]:
        """Finished `(step, value)` pairs in schedule order; with `wait`, every scheduled one. A failure
        in the worker is raised here."""
        out: list[tuple[int, T]] = []
        while self._pending and (wait or self._pending[0][1].done()):
            step, future = self._pending.popleft()
            out.append((step, future.result()))
        return out

    def close(self) -> list[tuple[int, T]]:
        """Wait for everything scheduled, stop the worker, and return the remaining results."""
        try:
            return self.results(wait=True)
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _sync_compute(self, snapshot: Metric[T], ready: torch.cuda.Event | None) -> T:
        if ready is None:
            snapshot.sync(self._group)
            return tree_to(snapshot.compute(), "cpu")  # type: ignore[no-any-return]
        device = snapshot.device
        with torch.cuda.device(device):
            stream = self._streams.setdefault(device, torch.cuda.Stream(device))
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                snapshot.sync(self._group)
                values: T = tree_to(snapshot.compute(), "cpu")
            stream.synchronize()
        return values
