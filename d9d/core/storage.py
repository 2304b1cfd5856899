"""Where a run's durable files live: a local (or NFS) directory, or an object store through `fsspec`.

    root = location("s3://bucket/runs", {"endpoint_url": "http://127.0.0.1:9000"})   # a StoragePath
    root = location("/mnt/nfs/runs")                                                 # a pathlib.Path
    step = root / "my-run" / "checkpoints" / "step-00000010"
    write_file(step / "manifest.json", data)     # whole object or nothing visible, on both

A `Location` is either a `pathlib.Path` (local files: the engine's code paths stay exactly as they were) or
a `StoragePath` (an fsspec URI: `s3://`, `gs://`, `memory://`, ...). `StoragePath` offers the subset of the
`Path` API the checkpoint code uses (`/`, `name`, `parent`, `exists`, `is_file`, `is_dir`, `iterdir`,
`glob`, `read_bytes`, `read_text`, `open`, `stat`), so that code is written once for both. The operations
that differ in kind go through the `Storage` protocol: `write_bytes` (local: write a temporary file and
rename it; object store: one PUT, which is visible whole or not at all), `remove_tree` and `move_tree`
(object stores have no directories and no rename; a move is a copy and a delete).

Object stores have no rename, so a commit there cannot be "write, then rename into place": the
checkpointer writes every file, checks each one is there at its size, then writes the manifest, then the
`latest` object (`d9d.engine.checkpoint.commit`). A reader trusts only a step whose manifest exists and
whose files match it, so a crash at any point leaves the previous commit as the newest.

Files that a library writes to a local disk (a tracker's store, an export written by its own writer) reach a
storage root through `TreeMirror` (incremental copies of local files and folders, and their restoration on
a fresh disk) and `copy_tree` (one folder, made equal at the target).

`fsspec` (and `s3fs` for `s3://`, `gcsfs` for `gs://`) is the optional `storage` extra; it is imported only
when a URI names a protocol.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

from d9d.core.files import atomic_write_bytes
from d9d.core.inflight import storage_operation

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class StorageError(RuntimeError):
    """A storage URI cannot be opened (unknown protocol, the `storage` extra missing, bad options)."""


def is_uri(value: str | Path) -> bool:
    """Whether `value` names an fsspec protocol (`s3://...`); `file://` counts as a local path."""
    match = _SCHEME.match(str(value))
    return match is not None and match.group(1) != "file"


class Storage(Protocol):
    """How bytes reach a store. Paths are the store's own strings (a local path, or a full URI)."""

    def write_bytes(self, path: str, data: bytes) -> None:
        """Visible whole or not at all to any reader, replacing what was there."""
        ...

    def remove_tree(self, path: str) -> None:
        """Remove a file or a directory (a prefix) and everything under it; missing is not an error."""
        ...

    def move_tree(self, path: str, target: str) -> None: ...


class LocalStorage:
    """A local or network file system: writes go through a temporary file and a rename."""

    def write_bytes(self, path: str, data: bytes) -> None:
        with storage_operation("writing", path):
            atomic_write_bytes(Path(path), data, fsync=True)

    def remove_tree(self, path: str) -> None:
        target = Path(path)
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)

    def move_tree(self, path: str, target: str) -> None:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(path).rename(target)


@dataclass(frozen=True)
class FsspecStorage:
    """An fsspec file system, rebuilt from (protocol, options) wherever it is used: a `StoragePath` travels
    between processes (a rank's checkpoint report) as two strings and a mapping."""

    protocol: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def fs(self) -> Any:
        try:
            import fsspec  # optional: only runs that name a storage URI need it
        except ImportError:
            raise StorageError(
                f"a {self.protocol}:// storage URI needs fsspec: pip install 'd9d[storage]'"
            ) from None
        try:
            # fsspec caches instances by their arguments: this is a dictionary lookup after the first call.
            return fsspec.filesystem(self.protocol, **dict(self.options))
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(f"cannot open {self.protocol}:// storage: {e}") from None

    def write_bytes(self, path: str, data: bytes) -> None:
        with storage_operation("writing", path):
            self.fs.pipe_file(path, data)

    def remove_tree(self, path: str) -> None:
        fs = self.fs
        fs.invalidate_cache()  # another process may have written under `path` since it was last listed
        try:
            if fs.isdir(path):
                fs.rm(path, recursive=True)
            elif fs.exists(path):
                fs.rm(path)
        except FileNotFoundError:
            pass

    def move_tree(self, path: str, target: str) -> None:
        fs = self.fs
        fs.invalidate_cache()
        # No rename on an object store: copy everything, then delete the source.
        fs.copy(path.rstrip("/") + "/", target.rstrip("/") + "/", recursive=True)
        fs.rm(path, recursive=True)


@dataclass(frozen=True)
class StorageStat:
    st_size: int
    st_mtime_ns: int  # a change marker: the modification time where the store gives one, else 0


@dataclass(frozen=True, order=True)
class StoragePath:
    """A file or directory (prefix) in an fsspec store, addressed by its full URI."""

    uri: str
    storage: FsspecStorage = field(compare=False)

    def __str__(self) -> str:
        return self.uri

    def __truediv__(self, name: str) -> StoragePath:
        return StoragePath(f"{self.uri.rstrip('/')}/{name}", self.storage)

    @property
    def name(self) -> str:
        return self.uri.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> StoragePath:
        head = self.uri.rstrip("/").rpartition("/")[0]
        if head.endswith(":/"):  # the bucket itself: its own parent, as Path("/").parent is "/"
            return self
        return StoragePath(head, self.storage)

    def resolve(self) -> StoragePath:
        return self

    @property
    def _fresh_fs(self) -> Any:
        """The file system with its listing cache dropped: other processes (the ranks, the coordinator)
        write into the same prefixes, and s3fs answers `exists`/`info` from a cached parent listing."""
        fs = self.storage.fs
        fs.invalidate_cache()
        return fs

    def exists(self) -> bool:
        return bool(self._fresh_fs.exists(self.uri))

    def is_file(self) -> bool:
        return bool(self._fresh_fs.isfile(self.uri))

    def is_dir(self) -> bool:
        return bool(self._fresh_fs.isdir(self.uri))

    def iterdir(self) -> Iterator[StoragePath]:
        fs = self._fresh_fs
        try:
            entries = fs.ls(self.uri, detail=False)
        except FileNotFoundError:
            return iter(())
        names = sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})
        return iter([self / n for n in names if n])

    def glob(self, pattern: str) -> Iterator[StoragePath]:
        """Direct children whose name matches `pattern` (no `**`, no `/`)."""
        return iter([p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)])

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        # Object stores have no directories; a prefix exists once something is written under it.
        self.storage.fs.makedirs(self.uri, exist_ok=True)

    def read_bytes(self) -> bytes:
        data: bytes = self.storage.fs.cat_file(self.uri)
        return data

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def open(self, mode: str = "rb") -> IO[bytes]:
        stream: IO[bytes] = self.storage.fs.open(self.uri, mode)
        return stream

    def stat(self) -> StorageStat:
        info: Mapping[str, Any] = self._fresh_fs.info(self.uri)
        if info.get("type") != "file":
            raise FileNotFoundError(self.uri)
        marker = info.get("ETag") or info.get("LastModified") or info.get("mtime") or info.get("created")
        return StorageStat(int(info.get("size") or 0), zlib.crc32(str(marker).encode()) if marker else 0)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.storage.fs.rm_file(self.uri)
        except FileNotFoundError:
            if not missing_ok:
                raise


Location = Path | StoragePath
"""Where a run's durable file or directory lives: local (`Path`) or in an fsspec store (`StoragePath`)."""

AnyLocation = TypeVar("AnyLocation", Path, StoragePath)
"""A function of a `Location` that returns one of the same kind."""


def location(uri: str | Path, options: Mapping[str, Any] | None = None) -> Location:
    """A local path for a path or a `file://` URI, a `StoragePath` for any other protocol."""
    text = str(uri)
    if not is_uri(text):
        return Path(text.removeprefix("file://")).expanduser()
    match = _SCHEME.match(text)
    assert match is not None
    storage = FsspecStorage(match.group(1), tuple(sorted((options or {}).items())))
    root = StoragePath(text.rstrip("/") if not text.endswith("://") else text, storage)
    storage.fs  # noqa: B018 - fail here, naming the URI, when the protocol cannot be opened
    return root


def storage_of(loc: Location) -> Storage:
    match loc:
        case Path():
            return LocalStorage()
        case StoragePath():
            return loc.storage


def write_file(loc: Location, data: bytes) -> None:
    """Write `data` to `loc`, replacing it; readers see the old content or the new one, never a mix."""
    if isinstance(loc, Path):
        loc.parent.mkdir(parents=True, exist_ok=True)
    storage_of(loc).write_bytes(str(loc), data)


def write_text(loc: Location, text: str) -> None:
    write_file(loc, text.encode())


def remove_tree(loc: Location) -> None:
    storage_of(loc).remove_tree(str(loc))


def move_tree(loc: Location, target: Location) -> None:
    storage_of(loc).move_tree(str(loc), str(target))


def _local_files(source: Path) -> list[tuple[Path, str]]:
    """(file, its name relative to `source`) of a file or of every file under a directory."""
    if source.is_file():
        return [(source, "")]
    if not source.is_dir():
        return []
    return [(p, p.relative_to(source).as_posix()) for p in sorted(source.rglob("*")) if p.is_file()]


def _same_place(source: Path, target: Location) -> bool:
    return isinstance(target, Path) and source.resolve() == target.resolve()


class TreeMirror:
    """Keeps copies of local files and directories at a `Location`, sending each file again only when it
    changed (size or modification time) since this mirror last sent it.

    A tracker's files stay where its library writes them (MLflow's SQLite file, TensorBoard's event files);
    `sync()` after each write interval and at the end of the run makes the storage root follow them. Each
    file is one `write_file`, so a reader sees a file's previous copy or its new one. JSON files go after
    the others: an index or config (`model.safetensors.index.json`, `config.json`) names the weight files,
    so a reader that finds it finds what it names. A source that is its own target (the storage root is the
    local run directory) is left alone."""

    def __init__(self, target: Location, sources: Mapping[str, Path]) -> None:
        """`sources` maps a name under `target` ("" for the target itself) to a local file or directory."""
        self.target = target
        self.sources = {
            name: path for name, path in sources.items() if not _same_place(path, _under(target, name))
        }
        self._sent: dict[Path, tuple[int, int]] = {}

    def restore(self) -> list[Path]:
        """Copy back each source that is missing locally but has a copy at the target (a run resumed on a
        node whose run directory is new): the tracker then continues its run instead of starting one that
        the next `sync` would copy over the old. A source present locally is never touched."""
        restored: list[Path] = []
        for name, source in self.sources.items():
            if source.exists():
                continue
            remote = _under(self.target, name)
            for found in list_files(remote):
                relative = str(found).removeprefix(str(remote)).strip("/")
                local = _under(source, relative)
                assert isinstance(local, Path)
                local.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(local, found.read_bytes())
                st = local.stat()
                self._sent[local] = (st.st_size, st.st_mtime_ns)  # the copy there is this file already
                restored.append(local)
        return restored

    def sync(self) -> list[Location]:
        """Copy what changed since the last call; returns where each copied file went."""
        pending: list[tuple[Path, Location, tuple[int, int]]] = []
        for name, source in self.sources.items():
            for path, relative in _local_files(source):
                try:
                    st = path.stat()
                except FileNotFoundError:  # removed between the listing and now
                    continue
                marker = (st.st_size, st.st_mtime_ns)
                if self._sent.get(path) != marker:
                    pending.append((path, _under(_under(self.target, name), relative), marker))
        pending.sort(key=lambda item: (item[0].suffix == ".json", str(item[0])))
        copied: list[Location] = []
        for path, dest, marker in pending:
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            write_file(dest, data)
            self._sent[path] = marker
            copied.append(dest)
        return copied


def _under(root: Location, relative: str) -> Location:
    """`root / "a/b"` as `root / "a" / "b"` (a `StoragePath` joins one name at a time)."""
    for part in relative.split("/"):
        if part:
            root = root / part
    return root


def copy_tree(source: Path, target: Location) -> list[Location]:
    """Copy a local file or directory to `target` (a file or a directory there); returns the files written.
    Files already under `target` that `source` lacks are removed afterwards, so `target` ends equal to it."""
    if not source.exists():  # never "equal to nothing": that would only empty the target
        raise FileNotFoundError(f"{source}: nothing to copy to {target}")
    copied = TreeMirror(target, {"": source}).sync()
    if _same_place(source, target):
        return copied
    wanted = {str(loc) for loc in copied}
    for existing in list_files(target):
        if str(existing) not in wanted:
            remove_tree(existing)
    return copied


def list_files(root: Location) -> list[Location]:
    """Every file under `root` (a directory or prefix), sorted; `[root]` for a file, `[]` when missing."""
    match root:
        case Path():
            if root.is_file():
                return [root]
            return sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
        case StoragePath():
            fs = root._fresh_fs
            if fs.isfile(root.uri):
                return [root]
            try:
                found = fs.find(root.uri)
            except FileNotFoundError:
                return []
            base = root.uri.split("://", 1)[1].strip("/")
            out: list[Location] = []
            for entry in sorted(str(e) for e in found):
                key = entry.split("://", 1)[-1].strip("/")
                relative = key[len(base) :].strip("/") if key.startswith(base) else key
                out.append(_under(root, relative))
            return out
