"""Coordinator storage without a funnel: checkpoint bytes travel between the ranks' object stores and one
storage actor on the coordinator's node, never through the coordinator actor.

    rank r (background thread)              coordinator's node                  coordinator actor
    ------------------------------          --------------------------------    -------------------------
    read chunk -> ray.put -> ref   ------>  NodeStore.write(ref): write, hash
    (at most `max_in_flight` chunks)        (CheckpointStore.write_chunk)
    rank 0: commit(step, reports)  -------------------------------------------> waits for the Arrivals
                                            NodeStore.arrived(...) -> sizes,     of every reported file
                                            sha256 (metadata)           <------ (metadata), then commits
    restart: manifest, then only the files (and byte ranges) this rank reads  <- NodeStore.read -> refs

- **Upload off the step.** `Uploader` takes a rank's written files and returns at once; one background
  thread streams them chunk by chunk, with at most `max_in_flight` chunks (each `chunk_bytes`) in flight,
  so a rank's memory for uploads is bounded whatever the checkpoint size. On rank 0 the commit call is
  queued behind the rank's own upload of that step, and the coordinator's commit waits until every
  reported file of every rank has arrived whole and hashes to its report. A rank killed mid-upload leaves
  its files incomplete: the commit never happens, and the previous commit stays `latest`. A new checkpoint
  waits for the previous step's upload and commit (one step in flight, like the engine's async save), and
  `close` waits for everything queued (the run's last checkpoint).
- **Bytes not through one actor.** `NodeStore` is a small actor pinned to the coordinator's node (node
  affinity, not soft). Chunk arguments are ObjectRefs: Ray moves them from the rank's node to that node
  directly. The store hashes each file as it arrives (`CheckpointStore.write_chunk`), so the commit reads
  nothing back; the coordinator asks it for the `Arrival`s, a few dozen bytes per file. Reads return the
  bytes as the actor's return objects, which the rank `ray.get`s from the object store.
- **Fetch only what is read.** `plan_fetch` decides from the commit's manifest and the DCP `.metadata`
  what a restarted rank reads when the world size is unchanged: its own files whole; the engine's other
  per-rank state files (`rank-<k>.pt`) not at all; of another rank's DCP data files only the byte ranges
  of items that rank might share (replicated tensors and non-tensor items, which DCP stores once for all
  ranks holding them); everything else whole. A tensor saved as exactly one chunk per rank, each chunk in
  another rank's file, is private to its writer: with the same world size and layout each rank loads back
  exactly the chunk it wrote. With a different world size (an elastic restart) every file is fetched.
  Whole files are checked against their sha256 before they are kept, and a file already held with the
  right sha256 is not fetched again. Range-fetched files are sparse (unfetched bytes read as zeros) and so
  never pass that check: the ranges come from a commit the coordinator verified against its manifest.

Layering: this module (the cluster layer) knows the engine's file names; the engine never imports Ray.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import queue
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from d9d.cluster.checkpoints import Arrival, CheckpointStore
from d9d.core.files import atomic_write
from d9d.engine.checkpoint import MANIFEST, rank_state_name, sha256_of, step_dir_name
from d9d.engine.checkpoint_io import METADATA, CheckpointError, read_dcp_metadata
from d9d.engine.runtime import CheckpointFile, RankCheckpointReport

_log = logging.getLogger(__name__)

# Chunks a rank keeps in flight (uploads and downloads alike): enough to keep the pipe busy while one chunk
# is written or read on the other side, few enough that a rank never holds much more than this × chunk.
MAX_IN_FLIGHT = 4


# == the coordinator's node =================================================================================


@dataclass
class TransferStats:
    """Bytes moved by a `NodeStore` (written = uploaded to it, served = read back by ranks)."""

    written_bytes: int = 0
    served_bytes: int = 0
    served_by_rank: dict[int, int] = field(default_factory=dict)
    refused_stale_chunks: int = 0


class NodeStore:
    """The storage actor on the coordinator's node: writes and serves checkpoint chunks, hashes arrivals.

    A sync actor with one thread: the chunks one rank submits run in submission order (Ray's ordering for
    a sequential actor), which the hash-on-arrival needs. Writes name their attempt; a chunk of an attempt
    older than the newest one seen is refused (a killed rank's last chunks may still be on their way when
    its successor uploads the same file)."""

    def __init__(self, root: Path, keep_last: int) -> None:
        self._store = CheckpointStore(root, keep_last)
        self._newest_attempt = -1
        self._writer: dict[tuple[int, str], int] = {}  # (step, file) -> the attempt that wrote it
        self._stats = TransferStats()

    def write(self, attempt: int, step: int, relative_path: str, offset: int, data: bytes) -> None:
        key = (step, relative_path)
        if attempt < self._newest_attempt or (offset > 0 and self._writer.get(key) != attempt):
            self._stats.refused_stale_chunks += 1
            raise RuntimeError(f"attempt {attempt} is no longer the current attempt of this run")
        self._newest_attempt = attempt
        self._store.write_chunk(step, relative_path, offset, data)
        self._writer[key] = attempt
        self._stats.written_bytes += len(data)

    def arrived(self, attempt: int, step: int, relative_paths: Sequence[str]) -> dict[str, Arrival | None]:
        """What `attempt` uploaded of these files of `step` so far (None: nothing)."""
        return {
            rel: self._store.arrival(step, rel) if self._writer.get((step, rel)) == attempt else None
            for rel in relative_paths
        }

    def forget(self, step: int) -> None:
        self._store.forget(step)
        self._writer = {k: v for k, v in self._writer.items() if k[0] != step}

    def read(self, rank: int, step: int, relative_path: str, offset: int, size: int) -> bytes:
        data = self._store.read_chunk(step, relative_path, offset, size)
        self._stats.served_bytes += len(data)
        self._stats.served_by_rank[rank] = self._stats.served_by_rank.get(rank, 0) + len(data)
        return data

    def size(self, step: int, relative_path: str) -> int:
        return self._store.size(step, relative_path)

    def stats(self) -> TransferStats:
        return self._stats


def start_node_store(root: Path, keep_last: int) -> Any:
    """A `NodeStore` on this process's node (called by the coordinator, which owns it: it dies with it).

    Restarted by Ray if its process dies: the calls in flight then fail, which fails the attempt (its
    uploads can no longer be verified), and the next attempt uploads to the restarted store."""
    node_id = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(NodeStore)
        .options(
            num_cpus=0,
            max_restarts=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(root, keep_last)
    )


# == rank side: upload ======================================================================================


@dataclass(frozen=True)
class CoordinatorTransfer:
    """Coordinator-storage mode: where this rank keeps its files and how big each transfer chunk is."""

    local_root: Path
    chunk_bytes: int
    max_in_flight: int = MAX_IN_FLIGHT


def upload_file(
    store: Any,
    attempt: int,
    step: int,
    path: Path,
    relative_path: str,
    chunk_bytes: int,
    max_in_flight: int,
) -> int:
    """Stream one file to the `NodeStore`, at most `max_in_flight` chunks outstanding; returns its size."""
    pending: collections.deque[Any] = collections.deque()
    offset = 0
    with path.open("rb") as src:
        while True:
            data = src.read(chunk_bytes)
            # The bytes go rank -> object store -> the store's node; the call carries only the reference.
            pending.append(store.write.remote(attempt, step, relative_path, offset, ray.put(data)))
            offset += len(data)
            if len(pending) >= max_in_flight:
                ray.get(pending.popleft())
            if len(data) < chunk_bytes:
                break
    while pending:
        ray.get(pending.popleft())
    return offset


Job = Callable[[], None]


class Uploader:
    """A rank's background uploads (module docstring): one thread, jobs in order, one step in flight."""

    def __init__(self, name: str = "d9d-upload") -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.raise_error()
        self._jobs.put(job)

    def wait(self) -> None:
        """Until every job submitted so far ran; raises the first failure."""
        self._jobs.join()
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"a background checkpoint upload failed: {self._error}") from self._error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._jobs.put(None)
            self._thread.join()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self._error is None:  # after a failure nothing more is sent: the step cannot commit
                    job()
            except BaseException as e:  # kept for the step thread, which raises it
                _log.warning("background checkpoint upload failed", exc_info=True)
                self._error = e
            finally:
                self._jobs.task_done()


def upload_report(
    store: Any, attempt: int, report: RankCheckpointReport, transfer: CoordinatorTransfer
) -> int:
    """Upload every file of a rank's report, then drop this rank's local steps older than the one before it:
    the coordinator's node holds everything committed, and the two newest steps stay here (the newest may
    never commit) so that a restart on this node does not download this rank's own files again."""
    moved = 0
    step_dir = Path(str(report.step_dir))
    for f in report.files:
        moved += upload_file(
            store,
            attempt,
            report.step,
            step_dir / f.relative_path,
            f.relative_path,
            transfer.chunk_bytes,
            transfer.max_in_flight,
        )
    steps = sorted(p for p in transfer.local_root.glob("step-*") if p.is_dir() and p.name < step_dir.name)
    for old in steps[:-1]:
        shutil.rmtree(old, ignore_errors=True)
    return moved


# == rank side: what a restarted rank reads =================================================================


@dataclass(frozen=True)
class Need:
    """One file to fetch: whole (`ranges` None, checked against its sha256) or only these byte ranges."""

    file: CheckpointFile
    ranges: tuple[tuple[int, int], ...] | None = None  # (offset, length), sorted, merged

    @property
    def nbytes(self) -> int:
        return self.file.size_bytes if self.ranges is None else sum(n for _, n in self.ranges)


def shared_ranges(metadata: Metadata, world_size: int) -> dict[str, list[tuple[int, int]]]:
    """Per DCP data file, the byte ranges of the items a rank other than its writer may load (same world
    size and layout): everything but the chunks of tensors saved as one chunk per rank, one per file."""
    storage = metadata.storage_data or {}
    files_of: dict[str, set[str]] = collections.defaultdict(set)
    for index, info in storage.items():
        files_of[index.fqn].add(info.relative_path)
    private = {
        fqn
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
        and len(md.chunks) == world_size
        and len(files_of.get(fqn, ())) == world_size
    }
    ranges: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for index, info in storage.items():
        ranges.setdefault(info.relative_path, [])
        if index.fqn not in private:
            ranges[info.relative_path].append((info.offset, info.length))
    return {name: _merged(spans) for name, spans in ranges.items()}


def _merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for offset, length in sorted(spans):
        if out and offset <= out[-1][0] + out[-1][1]:
            start, n = out[-1]
            out[-1] = (start, max(n, offset + length - start))
        else:
            out.append((offset, length))
    return out


def plan_fetch(
    manifest: Mapping[str, Any],
    rank: int,
    world_size: int | None,
    metadata: Metadata | None,
) -> list[Need]:
    """What rank `rank` of a `world_size`-rank attempt reads of a commit (module docstring: the rules).

    `manifest` is the commit's manifest (`files`: name -> {rank, size, sha256}; `ranks`); `metadata` its
    DCP `.metadata` when it has one. An unknown world size or a different one means every file."""
    files = {
        rel: CheckpointFile(rel, int(info["size"]), str(info["sha256"]))
        for rel, info in sorted(manifest["files"].items())
    }
    same_world = world_size is not None and sorted(manifest.get("ranks", ())) == list(range(world_size))
    if not same_world or world_size == 1:
        return [Need(f) for f in files.values()]
    assert world_size is not None
    shared = shared_ranges(metadata, world_size) if metadata is not None else {}
    needs: list[Need] = []
    for rel, f in files.items():
        writer = int(manifest["files"][rel]["rank"])
        if writer == rank:
            needs.append(Need(f))
        elif rel == rank_state_name(writer):
            continue  # another rank's RNG streams: `Checkpointer.load` reads only its own
        elif rel in shared:
            if shared[rel]:
                needs.append(Need(f, tuple(shared[rel])))
        else:
            needs.append(Need(f))
    return needs


@dataclass
class FetchResult:
    step_dir: Path
    fetched_bytes: int
    needs: tuple[Need, ...]


class Fetcher:
    """Fetches a commit's files from the `NodeStore` into a rank's local step directory."""

    def __init__(self, store: Any, rank: int, transfer: CoordinatorTransfer) -> None:
        self._store = store
        self._rank = rank
        self._transfer = transfer

    def fetch(self, step: int, files: Sequence[CheckpointFile], world_size: int | None) -> FetchResult:
        step_dir = self._transfer.local_root / step_dir_name(step)
        step_dir.mkdir(parents=True, exist_ok=True)
        manifest = self._manifest(step, step_dir, files)
        fetched = 0
        metadata = None
        if METADATA in manifest["files"]:
            meta_file = next(f for f in files if f.relative_path == METADATA)
            fetched += self._whole(step, step_dir, meta_file)
            try:
                metadata = read_dcp_metadata(step_dir / METADATA)
            except CheckpointError:
                _log.warning("cannot read %s; fetching every file", step_dir / METADATA, exc_info=True)
                world_size = None
        needs = plan_fetch(manifest, self._rank, world_size, metadata)
        for need in needs:
            if need.file.relative_path == METADATA:
                continue
            if need.ranges is None:
                fetched += self._whole(step, step_dir, need.file)
            else:
                fetched += self._ranges(step, step_dir, need)
        return FetchResult(step_dir, fetched, tuple(needs))

    def _manifest(self, step: int, step_dir: Path, files: Sequence[CheckpointFile]) -> dict[str, Any]:
        """The commit's manifest, kept locally (the engine reads it when it resumes), checked against what
        the coordinator says the commit holds."""
        size: int = ray.get(self._store.size.remote(step, MANIFEST))
        data = b"".join(self._read(step, MANIFEST, [(0, size)]))
        manifest: dict[str, Any] = json.loads(data)
        listed = {rel: (int(i["size"]), str(i["sha256"])) for rel, i in manifest["files"].items()}
        if listed != {f.relative_path: (f.size_bytes, f.sha256) for f in files}:
            raise CheckpointError(f"the manifest of step {step} does not list the files of its commit")
        atomic_write(step_dir / MANIFEST, lambda out: out.write(data))  # type: ignore[arg-type,return-value]
        return manifest

    def _whole(self, step: int, step_dir: Path, f: CheckpointFile) -> int:
        target = step_dir / f.relative_path
        if target.is_file() and target.stat().st_size == f.size_bytes and sha256_of(target) == f.sha256:
            return 0  # this rank wrote it itself, or fetched it before
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, functools.partial(self._write_whole, step, f))
        return f.size_bytes

    def _write_whole(self, step: int, f: CheckpointFile, out: BinaryIO) -> None:
        digest = hashlib.sha256()
        for data in self._read(step, f.relative_path, [(0, f.size_bytes)]):
            out.write(data)
            digest.update(data)
        if digest.hexdigest() != f.sha256:
            raise CheckpointError(f"checkpoint file {f.relative_path} of step {step} arrived corrupted")

    def _ranges(self, step: int, step_dir: Path, need: Need) -> int:
        assert need.ranges is not None
        target = step_dir / need.file.relative_path
        ranges = need.ranges
        if target.is_file() and sha256_of(target) == need.file.sha256:
            return 0  # held whole
        target.parent.mkdir(parents=True, exist_ok=True)

        def write(out: BinaryIO) -> None:
            out.truncate(need.file.size_bytes)  # sparse: the bytes this rank never reads stay holes
            chunks = iter(self._read(step, need.file.relative_path, ranges))
            for offset, length in ranges:
                out.seek(offset)
                remaining = length
                while remaining > 0:
                    data = next(chunks)
                    out.write(data)
                    remaining -= len(data)

        atomic_write(target, write)
        return need.nbytes

    def _read(self, step: int, relative_path: str, ranges: Sequence[tuple[int, int]]) -> Iterable[bytes]:
        """The bytes of `ranges`, chunk by chunk in order, at most `max_in_flight` chunks requested ahead."""
        chunk = self._transfer.chunk_bytes
        requests = (
            (offset + at, min(chunk, length - at))
            for offset, length in ranges
            for at in range(0, max(length, 1), chunk)
        )
        pending: collections.deque[Any] = collections.deque()
        for offset, size in requests:
            pending.append(self._store.read.remote(self._rank, step, relative_path, offset, size))
            if len(pending) >= self._transfer.max_in_flight:
                yield ray.get(pending.popleft())
        while pending:
            yield ray.get(pending.popleft())
