"""A device tensor on its way to host memory, read when needed instead of when queued."""

from __future__ import annotations

import torch


class HostCopy:
    """`tensor` copied to the host without waiting for it. On CUDA: a pinned buffer, the copy queued on the
    current stream and an event after it, so the host blocks only in `wait()` and only until the copy (not
    work queued later) is done. Elsewhere the copy is made at once. Either way it is a snapshot: later
    changes to `tensor` do not reach it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor.detach().to("cpu", copy=True)

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
