"""Collectives torch does not offer directly: tensors whose shapes differ per rank, and Python objects.

Var-shape gathers exchange shapes first (a small fixed-size collective), pad every tensor to the largest
element count, run one collective, and slice back. Objects are pickled to bytes and ride the same path,
which gives objects an async variant for free. Pickle is only used between our own ranks.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

_MAX_DIMS = 8
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


class PendingResult(Generic[T]):
    """Handle of an async collective: `wait()` blocks until the collective is done and returns the value."""

    def __init__(self, work: dist.Work | None, finish: Callable[[], T]) -> None:
        self._work = work
        self._finish = finish
        self._done = False
        self._value: T | None = None

    def wait(self) -> T:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            self._value = self._finish()
            self._done = True
        return self._value  # type: ignore[return-value]


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _encode_meta(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(
            f"var-shape collectives support at most {_MAX_DIMS} dims, got shape {tuple(tensor.shape)}"
        )
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"var-shape collectives do not support dtype {tensor.dtype}")
    meta = torch.full((_MAX_DIMS + 2,), -1, dtype=torch.int64)
    meta[0] = _DTYPES.index(tensor.dtype)
    meta[1] = tensor.dim()
    meta[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return meta.to(tensor.device)


def _decode_meta(meta: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    values = meta.tolist()
    ndim = int(values[1])
    return _DTYPES[int(values[0])], tuple(int(v) for v in values[2 : 2 + ndim])


def _exchange_meta(
    tensor: torch.Tensor, group: dist.ProcessGroup | None
) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    meta = _encode_meta(tensor)
    metas = [torch.empty_like(meta) for _ in range(_group_size(group))]
    dist.all_gather(metas, meta, group=group)
    decoded = [_decode_meta(m) for m in metas]
    dtypes = {d for d, _ in decoded}
    if len(dtypes) != 1:
        per_rank = ", ".join(f"rank {i}: {d}" for i, (d, _) in enumerate(decoded))
        raise ValueError(f"var-shape gather needs one dtype on every rank, got {per_rank}")
    return decoded


def _padded(tensor: torch.Tensor, numel: int) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == numel:
        return flat
    out = torch.zeros(numel, dtype=tensor.dtype, device=tensor.device)
    out[: flat.numel()] = flat
    return out


def _unpad(
    buffers: list[torch.Tensor], metas: list[tuple[torch.dtype, tuple[int, ...]]]
) -> list[torch.Tensor]:
    out = []
    for buf, (_, shape) in zip(buffers, metas, strict=True):
        numel = 1
        for s in shape:
            numel *= s
        out.append(buf[:numel].reshape(shape))
    return out


def all_gather_varshape_async(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> PendingResult[list[torch.Tensor]]:
    """All ranks get every rank's tensor, whatever its shape. Shapes are exchanged synchronously."""
    metas = _exchange_meta(tensor, group)
    numel = max(max(1, _numel(s)) for _, s in metas)
    send = _padded(tensor, numel)
    buffers = [torch.empty(numel, dtype=tensor.dtype, device=tensor.device) for _ in metas]
    work = dist.all_gather(buffers, send, group=group, async_op=True)
    return PendingResult(work, lambda: _unpad(buffers, metas))


def all_gather_varshape(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    return all_gather_varshape_async(tensor, group).wait()


def gather_varshape_async(
    tensor: torch.Tensor, dst: int = 0, group: dist.ProcessGroup | None = None
) -> PendingResult[list[torch.Tensor] | None]:
    """Like `all_gather_varshape_async`, but only global rank `dst` receives (others get None)."""
    metas = _exchange_meta(tensor, group)
    numel = max(max(1, _numel(s)) for _, s in metas)
    send = _padded(tensor, numel)
    is_dst = dist.get_rank() == dst
    buffers = (
        [torch.empty(numel, dtype=tensor.dtype, device=tensor.device) for _ in metas] if is_dst else None
    )
    work = dist.gather(send, gather_list=buffers, dst=dst, group=group, async_op=True)

    def finish() -> list[torch.Tensor] | None:
        return _unpad(buffers, metas) if buffers is not None else None

    return PendingResult(work, finish)


def gather_varshape(
    tensor: torch.Tensor, dst: int = 0, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor] | None:
    return gather_varshape_async(tensor, dst, group).wait()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _object_device(group: dist.ProcessGroup | None) -> torch.device:
    """Objects travel on CPU whenever the group has a CPU backend (gloo, or NCCL with gloo alongside)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _to_bytes_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)


def _from_bytes_tensor(tensor: torch.Tensor) -> Any:
    return pickle.loads(tensor.cpu().numpy().tobytes())  # bytes come from our own ranks only


def all_gather_object_async(obj: Any, group: dist.ProcessGroup | None = None) -> PendingResult[list[Any]]:
    pending = all_gather_varshape_async(_to_bytes_tensor(obj, _object_device(group)), group)
    return PendingResult(None, lambda: [_from_bytes_tensor(t) for t in pending.wait()])


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    return all_gather_object_async(obj, group).wait()


def gather_object_async(
    obj: Any, dst: int = 0, group: dist.ProcessGroup | None = None
) -> PendingResult[list[Any] | None]:
    pending = gather_varshape_async(_to_bytes_tensor(obj, _object_device(group)), dst, group)

    def finish() -> list[Any] | None:
        tensors = pending.wait()
        return None if tensors is None else [_from_bytes_tensor(t) for t in tensors]

    return PendingResult(None, finish)


def gather_object(obj: Any, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    return gather_object_async(obj, dst, group).wait()
