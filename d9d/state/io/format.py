"""The safetensors file format and the HF checkpoint layout, parsed and validated by hand.

We read headers ourselves instead of trusting the library to fail well: every way a file can be broken
(truncated, garbage header, offsets past the end, unknown dtype) becomes a `CheckpointFormatError` that
names the file and the key, before any tensor data is read. Each tensor is then its own private
mapping of the file (see `read_tensor`).

A checkpoint is either one `model.safetensors` or shards listed by `model.safetensors.index.json`
(`{"metadata": {"total_size": N}, "weight_map": {key: file}}`), as Hugging Face writes them.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from d9d.state.errors import CheckpointFormatError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: `[start, end)` as absolute file offsets."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FileHeader:
    path: Path
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: Path) -> FileHeader:
    """Parse and fully validate a safetensors header against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointFormatError(
                    f"{path}: truncated, {size} bytes is too short for a safetensors file"
                )
            (n,) = struct.unpack("<Q", prefix)
            if n > min(size - 8, _MAX_HEADER_BYTES):
                raise CheckpointFormatError(
                    f"{path}: corrupt header, it claims {n} bytes but the file has {size - 8} after the "
                    "length (truncated, or not a safetensors file)"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{path}: corrupt header, not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: corrupt header, expected a JSON object")
    data_start = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    entries = {key: _entry(path, key, spec, data_start, size) for key, spec in header.items()}
    _check_layout(path, entries, data_start, size)
    return FileHeader(path, entries, {str(k): str(v) for k, v in metadata.items()})


def _check_layout(path: Path, entries: Mapping[str, TensorEntry], data_start: int, size: int) -> None:
    """The `safetensors` library's own rule: taken in offset order, the tensors tile the data buffer
    exactly, from its first byte to the file's last, each starting where the previous ended. Overlapping
    tensors (two keys reading the same bytes), holes and trailing bytes are refused."""
    expected = data_start
    previous: str | None = None
    for key, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].end)):
        if entry.start != expected:
            begin, want = entry.start - data_start, expected - data_start
            if entry.start < expected:
                problem = (
                    f"overlaps {previous!r}: it starts at byte {begin}, before {previous!r} ends at {want}"
                )
            else:
                where = f"{previous!r} ends at" if previous is not None else "the data starts at"
                problem = f"leaves a hole: it starts at byte {begin}, but {where} {want}"
            raise CheckpointFormatError(f"{path}: invalid offsets, {key!r} {problem}")
        expected, previous = entry.end, key
    if expected != size:
        raise CheckpointFormatError(
            f"{path}: invalid offsets, the tensors end at byte {expected - data_start} of the data but the "
            f"file holds {size - data_start} bytes of data ({size - expected} bytes no tensor covers)"
        )


def _entry(path: Path, key: str, spec: Any, data_start: int, size: int) -> TensorEntry:
    try:
        dtype_name, shape, (begin, end) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointFormatError(f"{path}: corrupt header entry for {key!r}: {spec!r}") from e
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise CheckpointFormatError(f"{path}: {key!r} has unsupported dtype {dtype_name!r}")
    if (
        not all(isinstance(d, int) and d >= 0 for d in shape)
        or not isinstance(begin, int)
        or not isinstance(end, int)
    ):
        raise CheckpointFormatError(f"{path}: corrupt header entry for {key!r}: {spec!r}")
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * dtype.itemsize or begin < 0:
        raise CheckpointFormatError(
            f"{path}: {key!r} spans bytes [{begin}, {end}) but shape {shape} of {dtype_name} needs "
            f"{numel * dtype.itemsize}"
        )
    if data_start + end > size:
        raise CheckpointFormatError(
            f"{path}: truncated, {key!r} ends at byte {data_start + end} but the file has {size} bytes"
        )
    return TensorEntry(dtype, shape, data_start + begin, data_start + end)


def read_tensor(f: io.BufferedReader, path: Path, key: str, entry: TensorEntry) -> torch.Tensor:
    """One tensor, backed by its own private (copy-on-write) mapping of the file.

    A mapping per tensor, not per file: it is unmapped when the tensor dies, so RSS follows the live
    tensors, and no bytes are copied before the consumer copies them into parameters. Checkpoints are
    never modified in place (the writer renames new files in), which makes mapping them safe.
    """
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    if entry.start % entry.dtype.itemsize:  # misaligned for its dtype: copy instead of mapping
        return _read_copy(f, path, key, entry)
    base = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(
        f.fileno(),
        entry.end - base,
        flags=mmap.MAP_PRIVATE,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
        offset=base,
    )
    if _WILLNEED is not None:
        mapped.madvise(_WILLNEED)  # start readahead of the whole tensor now
    flat = torch.frombuffer(mapped, dtype=torch.uint8, offset=entry.start - base, count=entry.nbytes)
    return flat.view(entry.dtype).reshape(entry.shape)


_WILLNEED: int | None = getattr(mmap, "MADV_WILLNEED", None)


def _read_copy(f: io.BufferedReader, path: Path, key: str, entry: TensorEntry) -> torch.Tensor:
    buf = torch.empty(entry.nbytes, dtype=torch.uint8)
    f.seek(entry.start)
    got = f.readinto(buf.numpy())  # type: ignore[arg-type]  # an ndarray is a writable buffer
    if got != entry.nbytes:
        raise CheckpointFormatError(
            f"{path}: truncated while reading {key!r} ({got} of {entry.nbytes} bytes)"
        )
    return buf.view(entry.dtype).reshape(entry.shape)


def resolve_checkpoint(source: Path) -> tuple[dict[str, Path], Path]:
    """`(key -> file, layout file)` of a checkpoint dir (index or single file) or a `.safetensors` file.

    The layout file is the one errors should name when a key is missing: the index, or the single file.
    """
    if source.is_file():
        return dict.fromkeys(read_header(source).entries, source), source
    index = source / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointFormatError(f"{index}: corrupt index ({e})") from e
        files = {name: source / name for name in set(weight_map.values())}
        for name, path in files.items():
            if not path.is_file():
                raise CheckpointFormatError(f"{index}: lists {name!r}, which does not exist")
        return {key: files[name] for key, name in weight_map.items()}, index
    single = source / SINGLE_NAME
    if single.is_file():
        return dict.fromkeys(read_header(single).entries, single), single
    raise CheckpointFormatError(
        f"{source}: no checkpoint here (expected {INDEX_NAME} or {SINGLE_NAME}; "
        "an interrupted save leaves neither)"
    )


def write_file(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], *, fsync: bool = True
) -> int:
    """Write a safetensors file (header padded to 8 bytes); returns the bytes of tensor data."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    # Widest dtypes first: every tensor then starts aligned to its element size (the format allows no
    # padding), so readers can map it instead of copying.
    tensors = dict(sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0])))
    offset = 0
    for key, t in tensors.items():
        name = DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise CheckpointFormatError(
                f"{path}: {key!r} has dtype {t.dtype}, which safetensors cannot store"
            )
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": name, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(flat.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return offset


def write_index(path: Path, weight_map: Mapping[str, str], total_size: int, *, fsync: bool = True) -> None:
    body = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    with open(path, "w") as f:
        json.dump(body, f, indent=2)
        f.write("\n")
        f.flush()
        if fsync:
            os.fsync(f.fileno())
