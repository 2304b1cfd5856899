"""Streaming writer: source tensors in, mapped through groups, out to size-capped safetensors shards.

Tensors arrive in any order (`add`/`update`); each waits until its group is complete, then the group
runs and its outputs join the current shard buffer, which is written when the next tensor would push it
past `max_shard_bytes`. Host memory is therefore one shard plus one group.

Atomicity: everything goes to a hidden temp directory beside `dest` (`.<name>.partial-<id>`), which is
renamed into place only after every file and the index are written. A reader pointed at
`dest` finds nothing (or the previous checkpoint) until then, and never accepts the temp directory,
which has no index under the final names until the last step. With `fsync=True` (default) files, index
and directories are fsynced before the rename, so the commit also survives a node crash; `fsync=False`
keeps atomicity against a killed process only and leaves flushing to the OS.

Distributed mode (every rank of `group` constructs a writer): ranks share one temp directory and each
writes its own shards. Which rank writes a key is decided before any data moves, because every rank's
mapper outputs are known up front: with `write="auto"` (default) the lowest rank producing a key
writes it, so replicas (DP copies, gathered DTensors) are written once; every rank still runs its
mapper (DTensor gathers are collectives). At `commit` rank 0 checks that no key was written twice,
gives the files their final `model-XXXXX-of-YYYYY.safetensors` names, adds `extra_files` (e.g.
`config.json`), writes the index and renames the directory. Failures on any
rank are exchanged before the rename, so either every rank returns the committed path or every rank
raises.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Literal, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from d9d.core.dist_ops import all_gather_object
from d9d.state.errors import CheckpointFormatError, StateMappingError
from d9d.state.io.format import INDEX_NAME, SINGLE_NAME, write_file, write_index
from d9d.state.io.progress import progress_bar
from d9d.state.mapper.base import StateGroup, StateMapper, apply_group

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

# (temp file name, keys in it, bytes of tensor data) for every shard one rank wrote
ShardRecord = tuple[str, list[str], int]
T = TypeVar("T")


class StateWriter:
    """Write a mapper's outputs as an HF-style safetensors checkpoint at `dest`, atomically.

    Use as a context manager: a clean exit commits, an exception aborts (the temp directory is removed).
    """

    def __init__(
        self,
        dest: str | Path,
        mapper: StateMapper,
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        overwrite: bool = False,
        distributed: bool | None = None,
        group: dist.ProcessGroup | None = None,
        write: bool | Literal["auto"] = "auto",
        metadata: Mapping[str, str] | None = None,
        extra_files: Mapping[str, str | bytes] | None = None,
        fsync: bool = True,
        progress: bool | None = None,
    ) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
        self.dest = Path(dest).absolute()
        if self.dest.exists() and not overwrite:
            raise FileExistsError(f"{self.dest} exists; pass overwrite=True to replace it")
        self.mapper = mapper
        self.max_shard_bytes = max_shard_bytes
        self.overwrite = overwrite
        self.extra_files = dict(extra_files or {})
        for name in self.extra_files:
            if Path(name).name != name or name == INDEX_NAME or name.endswith(".safetensors"):
                raise ValueError(
                    f"extra_files: {name!r} must be a plain file name, not an index or weights file"
                )
        self.fsync = fsync
        self.metadata = {"format": "pt", **(metadata or {})}
        self.distributed = dist.is_initialized() if distributed is None else distributed
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1

        self._order = {g: i for i, g in enumerate(mapper.groups())}
        self._owner = {k: g for g in mapper.groups() for k in g.inputs}
        self._missing = {g: set(g.inputs) for g in mapper.groups()}
        self._pending: dict[str, torch.Tensor] = {}
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._records: list[ShardRecord] = []
        self._closed = False

        self.tmp = self._make_tmp_dir()
        self._keep = self._keys_to_write(write)
        self._bar = progress_bar(len(self._order), f"saving {self.dest.name}", "group", progress)
        self._run_ready([g for g, missing in self._missing.items() if not missing])

    def _keys_to_write(self, write: bool | Literal["auto"]) -> frozenset[str]:
        if write != "auto":
            return self.mapper.outputs() if write else frozenset()
        if not self.distributed:
            return self.mapper.outputs()
        owner: dict[str, int] = {}
        for rank, keys in enumerate(self._exchange(sorted(self.mapper.outputs()))):
            for key in keys:
                owner.setdefault(key, rank)
        return frozenset(k for k, r in owner.items() if r == self.rank)

    def _make_tmp_dir(self) -> Path:
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        name = f".{self.dest.name}.partial-{uuid.uuid4().hex[:12]}" if self.rank == 0 else None
        if self.distributed:
            name = all_gather_object(name, self.group)[0]
        assert name is not None
        tmp = self.dest.parent / name
        if self.rank == 0:
            tmp.mkdir()
        if self.distributed:
            dist.barrier(self.group)
        return tmp

    # -- feeding ------------------------------------------------------------------------------------

    def add(self, key: str, tensor: torch.Tensor) -> None:
        self.update({key: tensor})

    def update(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Hand over source tensors; completed groups run in the mapper's order (same on every rank)."""
        if self._closed:
            raise RuntimeError(f"writer for {self.dest} is already committed or aborted")
        ready: list[StateGroup] = []
        for key, tensor in tensors.items():
            group = self._owner.get(key)
            if group is None:
                raise StateMappingError(f"{key!r} is not an input of the save mapper {self.mapper!r}")
            if key not in self._missing[group]:
                raise StateMappingError(f"{key!r} was given twice to the writer for {self.dest}")
            self._missing[group].discard(key)
            self._pending[key] = tensor
            if not self._missing[group]:
                ready.append(group)
        self._run_ready(ready)

    def _run_ready(self, groups: list[StateGroup]) -> None:
        for group in sorted(groups, key=self._order.__getitem__):
            del self._missing[group]
            outputs = apply_group(self.mapper, group, {k: self._pending.pop(k) for k in group.inputs})
            for key in sorted(outputs):
                tensor = outputs.pop(key)
                if key in self._keep:
                    self._buffer_tensor(key, tensor)
            self._bar.update(1)

    def _buffer_tensor(self, key: str, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            raise StateMappingError(
                f"{key!r} is still a DTensor when saving to {self.dest}; gather it first "
                "(save_mapper adds Gather)"
            )
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[key] = tensor.detach().to("cpu")
        self._buffer_bytes += nbytes

    def _flush(self) -> None:
        if not self._buffer:
            return
        name = f"part-r{self.rank:05d}-{len(self._records):05d}.safetensors"
        size = write_file(self.tmp / name, self._buffer, self.metadata, fsync=self.fsync)
        self._records.append((name, list(self._buffer), size))
        self._buffer, self._buffer_bytes = {}, 0

    # -- finishing ----------------------------------------------------------------------------------

    def commit(self) -> Path:
        """Write the last shard, merge the index (rank 0) and rename the checkpoint into place."""
        if self._closed:
            raise RuntimeError(f"writer for {self.dest} is already committed or aborted")
        self._closed = True
        error: str | None = None
        try:
            if self._missing:
                keys = sorted(k for missing in self._missing.values() for k in missing)
                raise StateMappingError(
                    f"save to {self.dest} is incomplete: {len(self._missing)} group(s) still miss "
                    f"{len(keys)} input(s), e.g. {keys[:5]}"
                )
            self._flush()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        records = self._exchange((error, self._records))
        failures = [f"rank {r}: {err}" for r, (err, _) in enumerate(records) if err is not None]
        status: str | None = None
        if self.rank == 0:
            status = "; ".join(failures) if failures else self._finalize([recs for _, recs in records])
        outcome = self._exchange(status)[0]
        self._bar.close()
        if failures or outcome is not None:
            self._remove_tmp()
            if self.distributed:  # when commit raises, every rank sees the same (clean) filesystem
                dist.barrier(self.group)
            raise CheckpointFormatError(f"saving {self.dest} failed: {'; '.join(failures) or outcome}")
        return self.dest

    def _exchange(self, obj: T) -> list[T]:
        return all_gather_object(obj, self.group) if self.distributed else [obj]

    def _finalize(self, per_rank: list[list[ShardRecord]]) -> str | None:
        """Rank 0: final names, index, rename. Returns an error message instead of raising, so every
        rank learns about it."""
        try:
            owner: dict[str, int] = {}
            for rank, records in enumerate(per_rank):
                for _, keys, _ in records:
                    for key in keys:
                        if key in owner:
                            raise StateMappingError(
                                f"{key!r} was written by ranks {owner[key]} and {rank}; "
                                "use write='auto' or write=False on replicas"
                            )
                        owner[key] = rank
            files = [rec for records in per_rank for rec in records]
            weight_map: dict[str, str] = {}
            for i, (name, keys, _) in enumerate(files):
                final = (
                    SINGLE_NAME if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                )
                os.replace(self.tmp / name, self.tmp / final)
                weight_map.update(dict.fromkeys(keys, final))
            if len(files) != 1:
                write_index(
                    self.tmp / INDEX_NAME, weight_map, sum(size for _, _, size in files), fsync=self.fsync
                )
            for name, content in self.extra_files.items():
                data = content.encode() if isinstance(content, str) else content
                with open(self.tmp / name, "wb") as f:
                    f.write(data)
                    if self.fsync:
                        os.fsync(f.fileno())
            if self.fsync:
                _fsync_dir(self.tmp)
            self._swap_into_place()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    def _swap_into_place(self) -> None:
        old = None
        if self.dest.exists():
            if not self.overwrite:
                raise FileExistsError(f"{self.dest} appeared during the save; not replacing it")
            old = self.dest.parent / f".{self.dest.name}.replaced-{uuid.uuid4().hex[:12]}"
            os.replace(self.dest, old)
        os.replace(self.tmp, self.dest)
        if self.fsync:
            _fsync_dir(self.dest.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Drop everything written so far; `dest` is untouched."""
        if self._closed:
            return
        self._closed = True
        self._bar.close()
        self._buffer.clear()
        self._pending.clear()
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        for name, _, _ in self._records:
            (self.tmp / name).unlink(missing_ok=True)
        if self.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> StateWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
