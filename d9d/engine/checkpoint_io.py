"""DCP storage that hashes what it writes and never runs code from what it reads.

- `HashingWriter` is torch DCP's file writer with a file system that feeds every byte written through
  sha256 on its way to disk, so a rank's checkpoint report carries each file's hash without reading the
  file back.
- `SafeReader` reads `.metadata` through `read_dcp_metadata`, an unpickler that resolves only the
  checkpoint metadata types (an allow-list); DCP's own reader calls `pickle.load` on it, which runs whatever
  the file asks for.
- `SafeLoadPlanner` loads the non-tensor items of a `.distcp` file (optimizer hyper-parameters and the like)
  with `torch.load(weights_only=True)`; DCP's default planner uses `weights_only=False`.
- `load_state_file` is the same rule for the engine's own state files (`engine.pt`, `rank-*.pt`).

Every refusal raises `UnsafeCheckpointError` naming the file.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import threading
from collections import OrderedDict
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PosixPath, PurePosixPath
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.serialization import _get_layout

from d9d.core.inflight import storage_operation
from d9d.core.storage import Location, StoragePath

METADATA = ".metadata"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found, verified or loaded; the message names the file or directory."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asked for something outside the allow-list, or could not be read at all."""


# -- writing -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WrittenFile:
    size: int
    sha256: str


class _HashingStream(io.RawIOBase):
    """A binary file opened for writing that hashes every byte it passes on."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self._raw = raw
        self._digest = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._digest.update(view)
        self.size += view.nbytes
        return self._raw.write(view)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        if not self._raw.closed:  # IOBase.close() flushes after the raw file is gone
            self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if not self._raw.closed:
            self._raw.flush()
            self._raw.close()
        super().close()

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()


class _HashingFileSystem(FileSystem):
    """Records (size, sha256) of every file written through it, by final file name (DCP renames
    `.metadata.tmp` to `.metadata` once it is complete)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.written: dict[str, WrittenFile] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        target = Path(path)
        with storage_operation("writing", str(target)), target.open(mode) as raw:
            stream = _HashingStream(cast(IO[bytes], raw))
            yield stream
            stream.flush()
        with self._lock:
            self.written[target.name] = WrittenFile(stream.size, stream.sha256)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            record = self.written.pop(Path(path).name, None)
            if record is not None:
                self.written[Path(new_path).name] = record


class _StorageFileSystem(FsspecFileSystem):
    """DCP's fsspec file system bound to a `StoragePath`'s configured store. DCP re-initializes its path on
    every save and load (`reset(checkpoint_id)`), which builds the file system from the URI alone and so
    would drop the storage options (endpoint, credentials); this one keeps them."""

    def __init__(self, path: StoragePath) -> None:
        super().__init__()
        self.fs = path.storage.fs

    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str | os.PathLike[str]:
        return path


class _HashingFsspecFileSystem(_StorageFileSystem):
    """The same record as `_HashingFileSystem`, for files written through fsspec (object stores)."""

    def __init__(self, path: StoragePath) -> None:
        super().__init__(path)
        self._lock = threading.Lock()
        self.written: dict[str, WrittenFile] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with storage_operation("writing", self._uri(path)), super().create_stream(path, mode) as raw:
            stream = _HashingStream(cast(IO[bytes], raw))
            yield stream
            stream.flush()
        with self._lock:
            self.written[PurePosixPath(str(path)).name] = WrittenFile(stream.size, stream.sha256)

    def _uri(self, path: str | os.PathLike[str]) -> str:
        text = str(path)
        if "://" in text:
            return text
        protocol = getattr(self.fs, "protocol", "file")
        return f"{protocol[0] if isinstance(protocol, (tuple, list)) else protocol}://{text}"

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            record = self.written.pop(PurePosixPath(str(path)).name, None)
            if record is not None:
                self.written[PurePosixPath(str(new_path)).name] = record


class HashingFsspecWriter(FsspecWriter):
    """`HashingWriter` for a `StoragePath`: DCP's fsspec writer, hashing as it writes, never overwriting."""

    def __init__(self, path: StoragePath) -> None:
        super().__init__(str(path), overwrite=False, **dict(path.storage.options))
        hashing = _HashingFsspecFileSystem(path)
        self._hashing = hashing
        self.fs = hashing  # type: ignore[assignment]  # DCP's own fsspec writer replaces `fs` the same way

    @property
    def written(self) -> dict[str, WrittenFile]:
        return dict(self._hashing.written)


def hashing_writer(path: Location) -> HashingWriter | HashingFsspecWriter:
    """The hashing DCP writer for a local directory or a storage URI."""
    match path:
        case Path():
            return HashingWriter(path)
        case StoragePath():
            return HashingFsspecWriter(path)


class HashingWriter(FileSystemWriter):
    """DCP's file writer; refuses a directory that already holds `.metadata` (a committed or half-committed
    save is never written over) and reports what it wrote in `written`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, overwrite=False)
        self._hashing = _HashingFileSystem()
        self.fs = self._hashing

    @property
    def written(self) -> dict[str, WrittenFile]:
        return dict(self._hashing.written)


def hashed_bytes(data: bytes) -> WrittenFile:
    return WrittenFile(len(data), hashlib.sha256(data).hexdigest())


# -- reading -----------------------------------------------------------------------------------------------

_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
)

_MD = "torch.distributed.checkpoint.metadata"
# Exactly what torch DCP pickles into `.metadata`; every entry only builds plain data.
_ALLOWED: dict[tuple[str, str], Any] = {
    (_MD, "Metadata"): dcp_metadata.Metadata,
    (_MD, "TensorStorageMetadata"): dcp_metadata.TensorStorageMetadata,
    (_MD, "BytesStorageMetadata"): dcp_metadata.BytesStorageMetadata,
    (_MD, "ChunkStorageMetadata"): dcp_metadata.ChunkStorageMetadata,
    (_MD, "TensorProperties"): dcp_metadata.TensorProperties,
    (_MD, "MetadataIndex"): dcp_metadata.MetadataIndex,
    (_MD, "StorageMeta"): dcp_metadata.StorageMeta,
    (_MD, "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): PosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", str(dtype).removeprefix("torch.")): dtype for dtype in _DTYPES},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not a checkpoint metadata type")
        return allowed


def read_dcp_metadata(path: Location) -> dcp_metadata.Metadata:
    """Unpickle a DCP `.metadata` file with nothing but the metadata types resolvable."""
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UnsafeCheckpointError(f"{path} is missing") from None
    except Exception as e:
        raise UnsafeCheckpointError(f"{path} is not a checkpoint metadata file: {e}") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not checkpoint metadata")
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path if isinstance(info, _StorageInfo) else None
        if name is None or Path(name).name != name or name in ("", ".", ".."):
            raise UnsafeCheckpointError(f"{path} points outside its directory ({name!r})")
    return metadata


def _safe_metadata(directory: Location, load_id: Any, kwargs: dict[str, Any]) -> dcp_metadata.Metadata:
    rank = kwargs.get("rank")  # set only when ranks saved without collectives (own metadata files)
    metadata = read_dcp_metadata(directory / (METADATA if rank is None else f"__{rank}{METADATA}"))
    if metadata.storage_meta is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        return _safe_metadata(Path(self.path), self.load_id, kwargs)


class SafeFsspecReader(FsspecReader):
    """`SafeReader` for a `StoragePath` (DCP's fsspec reader, `.metadata` through the allow-list)."""

    def __init__(self, path: StoragePath) -> None:
        super().__init__(str(path), **dict(path.storage.options))
        self.fs = _StorageFileSystem(path)  # type: ignore[assignment]  # as DCP's own fsspec reader does
        self._location = path

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        return _safe_metadata(self._location, self.load_id, kwargs)


def safe_reader(path: Location) -> SafeReader | SafeFsspecReader:
    match path:
        case Path():
            return SafeReader(path)
        case StoragePath():
            return SafeFsspecReader(path)


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor items come back through the weights-only unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:
            raise UnsafeCheckpointError(
                f"item {read_item.storage_index.fqn} of the checkpoint is not plain data: {_first_line(e)}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_state_file(path: Location) -> Any:
    """A `torch.save`d engine/rank state file, loaded weights-only (tensors, containers, numbers)."""
    try:
        source = path if isinstance(path, Path) else io.BytesIO(path.read_bytes())
        return torch.load(source, weights_only=True)
    except FileNotFoundError:
        raise UnsafeCheckpointError(f"{path} is missing") from None
    except Exception as e:
        raise UnsafeCheckpointError(f"{path} cannot be loaded as plain state: {_first_line(e)}") from None


def _first_line(error: BaseException) -> str:
    """The informative part of torch's weights-only refusal (the rest is a how-to about the flag)."""
    text = str(error).strip()
    for line in text.splitlines():
        if "Unsupported" in line or "global" in line.lower():
            return line.strip()
    return text.splitlines()[0] if text else type(error).__name__
