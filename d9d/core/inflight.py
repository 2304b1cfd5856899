"""Storage operations in flight in this process, so that a watchdog can say which one is stalled: what it
is doing, on which file of which store, since when.

    with storage_operation("writing", "/ckpt/step-00000010/__0_0.distcp"):
        ...                                          # `operations()` lists it meanwhile
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Operation:
    id: int
    what: str  # "writing", "reading", ...
    where: str  # a local path or a storage URI
    started: float  # monotonic

    @property
    def store(self) -> str:
        """The store `where` is on: `s3://bucket` for a URI, `local disk` for a path."""
        parts = urlsplit(self.where)
        if parts.scheme and parts.scheme != "file" and "://" in self.where:
            return f"{parts.scheme}://{parts.netloc}"
        return "local disk"

    def describe(self, now: float | None = None) -> str:
        took = (now if now is not None else time.monotonic()) - self.started
        return f"{self.what} {self.where} ({self.store}) for {took:.0f}s"


_lock = threading.Lock()
_ops: dict[int, Operation] = {}
_ids = itertools.count()


@contextlib.contextmanager
def storage_operation(what: str, where: str) -> Iterator[Operation]:
    op = Operation(next(_ids), what, str(where), time.monotonic())
    with _lock:
        _ops[op.id] = op
    try:
        yield op
    finally:
        with _lock:
            _ops.pop(op.id, None)


def operations() -> list[Operation]:
    """The operations in flight now, oldest first."""
    with _lock:
        return sorted(_ops.values(), key=lambda op: op.started)
