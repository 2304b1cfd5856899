"""Loading the next steps' batches on a background thread while the current step computes.

The wrapped source is called exactly as it would be on the step thread — `next_step()` after `next_step()`,
one at a time, from one thread — so the batches and their order are the same; only *when* they are made
changes. Tokenization, file reads and collation then overlap with the forward/backward (PyTorch kernels
and most I/O release the GIL).

Exact resume: the source's own state runs ahead of training by up to `depth` steps, so the loader takes a
snapshot of it right after making each step and reports, as its state, the snapshot of the last step the
trainer *took*. Loading a state stops the thread, drops what was prefetched, loads the source and starts
again from there.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class StepSource(Protocol):
    """What the loader wraps (the engine's `DataProvider` after `setup`)."""

    def next_step(self) -> list[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class _Ready:
    batches: list[Any]
    state_after: dict[str, Any]


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class PrefetchingLoader:
    """Keeps up to `depth` steps of `source` ready on a daemon thread; `depth=0` loads on the caller's thread.

    A source error is raised from the `next_step` call that would have returned that step. Call `close()`
    when done (a closed loader can be restarted by `load_state_dict`).
    """

    def __init__(self, source: StepSource, depth: int) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth={depth} must be >= 0")
        self.source = source
        self.depth = depth
        self._state = copy.deepcopy(source.state_dict())
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _produce(self, stop: threading.Event, out: queue.Queue[Any]) -> None:
        while not stop.is_set():
            try:
                item: Any = _Ready(self.source.next_step(), copy.deepcopy(self.source.state_dict()))
            except BaseException as e:  # handed to the consumer, which raises it on the step thread
                item = _Failed(e)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failed) or (isinstance(item, _Ready) and not item.batches):
                return  # the source is exhausted or broken: nothing more to make

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(
            target=self._produce, args=(self._stop, self._queue), name="d9d-data-prefetch", daemon=True
        )
        self._thread.start()

    def next_step(self) -> list[Any]:
        if self.depth == 0:
            batches = self.source.next_step()
            self._state = self.source.state_dict()
            return batches
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        assert isinstance(item, _Ready)
        if not item.batches:
            # the source ran out: stay exhausted (as a source on the step thread would) instead of
            # waiting on a producer that has finished
            self._queue.put(item)
        self._state = item.state_after
        return item.batches

    def state_dict(self) -> dict[str, Any]:
        """The source's state after the last step handed out (what a resume must continue from)."""
        if self.depth == 0:
            return self.source.state_dict()
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.close()
        self.source.load_state_dict(state)
        self._state = copy.deepcopy(dict(state))

    def close(self) -> None:
        """Stop the thread and drop the prefetched steps; the source is put back where training is."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        if self.depth > 0:
            # the source ran ahead: put it back where training is, so a later next_step continues exactly
            self.source.load_state_dict(self._state)
