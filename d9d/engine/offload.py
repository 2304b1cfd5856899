"""Sleep and wake: a rank's training state leaves the device between phases and comes back bit for bit.

Sleeping copies the bytes of every device storage behind the parameters, their gradients, the module
buffers and the optimizer state into host memory (pinned on CUDA, so the copies run at full bus speed), then
shrinks each device storage to zero bytes and empties the CUDA caching allocator. Waking grows the storages
back to their size and copies the bytes in.

The tensors themselves never change: the same `Parameter` objects stay registered on the modules, the
optimizer's state stays keyed by them, and every view of a storage (FSDP2's padded shard buffer and the
DTensor's local shard, gradient buckets and the gradients viewing them) follows its storage. That is why the
unit is the storage, not the tensor: resizing it is what FSDP2 itself does with unsharded parameters, and
no reference anywhere has to be rewired. While asleep a tensor has no bytes, so any use of it fails loudly
instead of computing on stale data.

Host memory is allocated in pages (`PAGE_BYTES`) that storages are packed into back to back, a storage
spanning pages where needed: one pinned allocation per storage would be rounded up to a power of two by
the CUDA host allocator, close to doubling the host memory of a large model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

PAGE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class SleepReport:
    storages: int  # device storages moved to the host
    offloaded_bytes: int
    kept_bytes: int  # storages that cannot be resized (external memory) stay on the device
    seconds: float
    # torch.cuda.memory_allocated on CUDA; None on other devices.
    device_allocated_before: int | None
    device_allocated_after: int | None


@dataclass(frozen=True)
class WakeReport:
    restored_bytes: int
    seconds: float
    device_allocated_after: int | None


@dataclass(frozen=True)
class _Segment:
    """`length` bytes of one storage at `storage_offset` live in host page `page` at `page_offset`."""

    storage_offset: int
    page: int
    page_offset: int
    length: int


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int
    segments: list[_Segment]


def training_state_tensors(
    modules: Sequence[nn.Module], optimizers: Iterable[torch.optim.Optimizer]
) -> list[torch.Tensor]:
    """Parameters, their gradients, buffers and optimizer state tensors (DTensors as their local shards)."""
    found: list[torch.Tensor] = []
    for module in modules:
        for param in module.parameters():
            found.append(param)
            if param.grad is not None:
                found.append(param.grad)
        found.extend(module.buffers())
    for optimizer in optimizers:
        for state in optimizer.state.values():
            found.extend(_tensors_in(state))
    return [_local(t) for t in found]


def _tensors_in(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors_in(v)


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor has no storage of its own; its local shard shares the storage the model really holds.
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of `storage`."""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return view.set_(storage, 0, (storage.nbytes(),), (1,))  # type: ignore[call-overload]


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_allocated(device))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostOffload:
    """Moves the storages of given tensors that live on `device` to host memory and back."""

    def __init__(self, device: torch.device, page_bytes: int = PAGE_BYTES) -> None:
        self.device = device
        self.page_bytes = page_bytes
        self.pinned = device.type == "cuda"
        self._moved: list[_Moved] = []
        self._pages: list[torch.Tensor] = []
        self._asleep = False

    @property
    def asleep(self) -> bool:
        return self._asleep

    @property
    def host_bytes(self) -> int:
        """Bytes currently held in host pages (0 while awake)."""
        return sum(p.numel() for p in self._pages)

    @property
    def host_pinned(self) -> bool:
        """Every host page holding the state is pinned (always, on CUDA, while asleep)."""
        return bool(self._pages) and all(p.is_pinned() for p in self._pages)

    def sleep(self, tensors: Iterable[torch.Tensor]) -> SleepReport:
        if self._asleep:
            raise RuntimeError("HostOffload.sleep: already asleep; wake() first")
        start = time.perf_counter()
        _synchronize(self.device)  # the last step's kernels may still be writing these tensors
        before = _allocated(self.device)
        storages, kept = self._storages(tensors)
        self._moved = self._pack(storages)
        self._pages = self._allocate_pages(self._moved)
        for moved in self._moved:
            src = _bytes(moved.storage)
            for seg in moved.segments:
                page = self._pages[seg.page]
                page[seg.page_offset : seg.page_offset + seg.length].copy_(
                    src[seg.storage_offset : seg.storage_offset + seg.length], non_blocking=self.pinned
                )
        _synchronize(self.device)  # the copies must land before their sources are freed
        for moved in self._moved:
            moved.storage.resize_(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._asleep = True
        return SleepReport(
            storages=len(self._moved),
            offloaded_bytes=sum(m.nbytes for m in self._moved),
            kept_bytes=kept,
            seconds=time.perf_counter() - start,
            device_allocated_before=before,
            device_allocated_after=_allocated(self.device),
        )

    def wake(self) -> WakeReport:
        if not self._asleep:
            raise RuntimeError("HostOffload.wake: not asleep")
        start = time.perf_counter()
        for moved in self._moved:
            moved.storage.resize_(moved.nbytes)
        for moved in self._moved:
            dst = _bytes(moved.storage)
            for seg in moved.segments:
                page = self._pages[seg.page]
                dst[seg.storage_offset : seg.storage_offset + seg.length].copy_(
                    page[seg.page_offset : seg.page_offset + seg.length], non_blocking=self.pinned
                )
        _synchronize(self.device)  # the pages are released next; the copies must have read them
        restored = sum(m.nbytes for m in self._moved)
        self._moved, self._pages = [], []
        self._asleep = False
        return WakeReport(
            restored_bytes=restored,
            seconds=time.perf_counter() - start,
            device_allocated_after=_allocated(self.device),
        )

    def _here(self, device: torch.device) -> bool:
        # `cuda` (the current device) and `cuda:0` name the same device
        return device.type == self.device.type and (
            self.device.index is None or device.index is None or device.index == self.device.index
        )

    def _storages(self, tensors: Iterable[torch.Tensor]) -> tuple[list[torch.UntypedStorage], int]:
        """The distinct non-empty storages on this device (views share one), and the bytes of those that
        cannot be resized (memory the tensor does not own, e.g. a memory-mapped file): they stay."""
        seen: set[int] = set()
        storages: list[torch.UntypedStorage] = []
        kept = 0
        for t in tensors:
            if not self._here(t.device):
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            if storage.resizable():
                storages.append(storage)
            else:
                kept += storage.nbytes()
        return storages, kept

    def _pack(self, storages: list[torch.UntypedStorage]) -> list[_Moved]:
        moved: list[_Moved] = []
        page, used = 0, 0
        for storage in storages:
            nbytes, offset, segments = storage.nbytes(), 0, []
            while offset < nbytes:
                if used == self.page_bytes:
                    page, used = page + 1, 0
                length = min(nbytes - offset, self.page_bytes - used)
                segments.append(_Segment(offset, page, used, length))
                offset += length
                used += length
            moved.append(_Moved(storage, nbytes, segments))
        return moved

    def _allocate_pages(self, moved: list[_Moved]) -> list[torch.Tensor]:
        sizes: dict[int, int] = {}
        for m in moved:
            for seg in m.segments:
                sizes[seg.page] = max(sizes.get(seg.page, 0), seg.page_offset + seg.length)
        return [
            torch.empty(sizes[p], dtype=torch.uint8, device="cpu", pin_memory=self.pinned)
            for p in range(len(sizes))
        ]
