"""A bucket: one flat gradient buffer, its parameters' views into it, and its in-flight all-reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from d9d.core.dtensor import local_tensor


def scale_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply `tensors` in place by the 0-dim `factor`: one `_foreach_mul_` per (device, dtype), the factor
    moved to each device once. It stays a tensor: reading it to the host for the Python-scalar fast path
    would be a sync. A float32 factor beside bf16 tensors takes `_foreach_mul_`'s per-tensor path (its fast
    path wants the tensors' dtype, which would round the factor), bitwise `t.mul_(factor)` for each."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), group in groups.items():
        torch._foreach_mul_(group, factor.to(device))


class GradBucket:
    """Gradients of some parameters, accumulated into one buffer so a single collective reduces them all.

    Accumulating straight into the buffer (instead of reducing `param.grad` tensors) lets microbatches add
    up in `dtype` (e.g. float32 for bf16 weights) and frees each `param.grad` as soon as it was consumed.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.params = params
        self.group = group
        shapes = [local_tensor(p).shape for p in params]
        numels = [s.numel() for s in shapes]
        self.buffer = torch.zeros(sum(numels), dtype=dtype, device=device)
        self._views: list[torch.Tensor] = []
        offset = 0
        for shape, numel in zip(shapes, numels, strict=True):
            self._views.append(self.buffer[offset : offset + numel].view(shape))
            offset += numel
        self.touched = False
        self._missing = len(params)
        self._work: dist.Work | None = None
        self.launched = False

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def ready(self) -> bool:
        return self._missing == 0

    def view(self, index: int) -> torch.Tensor:
        return self._views[index]

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        if not self.touched:
            self.buffer.zero_()
            self.touched = True
        self._views[index].add_(grad)

    def mark_complete(self) -> None:
        self._missing -= 1

    def launch(self) -> None:
        if not self.touched:  # nothing arrived this step (unused parameters): reduce zeros, not stale data
            self.buffer.zero_()
            self.touched = True
        if self.group is not None:
            self._work = dist.all_reduce(self.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.launched = True

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def reset(self) -> None:
        self.touched = False
        self.launched = False
        self._missing = len(self.params)
