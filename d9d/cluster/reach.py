"""Local paths under `d9d submit`: resolved where the user typed them, and proven visible on the cluster.

A job submitted through the Ray Jobs API runs in an unpacked copy of the working directory on the head
node, so a relative `run.dir` would put every output into Ray's temporary package directory, where the
user never finds it. `d9d submit` therefore resolves each relative local path of the job on the submitting
machine (`pin_relative_paths`), passes the absolute paths on as overrides, and drops a marker file into
each directory. The job's driver (`check_submitted_paths`, called while the job is loaded) looks for the
markers and refuses to start, naming the key, when it cannot see one: the directory is not on storage the
cluster shares with the submitting machine. Absolute paths are taken as the cluster's own and left alone;
storage URIs (`run.storage: s3://...`) need no check. With an object store as `run.storage`, a relative
`run.dir` and `checkpointing.export_hf_dir` are not pinned either: they are the cluster's node-local
scratch, and what the run keeps is copied from them to the store (docs/engine.md "Storage root").
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from d9d.core.storage import is_uri
from d9d.engine.errors import ConfigError

if TYPE_CHECKING:
    from d9d.cluster.spec import JobSpec

SUBMITTED_PATHS_ENV = "D9D_SUBMITTED_PATHS"
MARKER = ".d9d-submitted"


@dataclass(frozen=True)
class PinnedPath:
    key: str  # the dotted config key, for messages and the override
    path: str  # absolute, on the submitting machine
    token: str  # the marker's content; "" for a path that is only checked for existence


@dataclass(frozen=True)
class Pinned:
    paths: tuple[PinnedPath, ...]

    @property
    def overrides(self) -> list[str]:
        """`--set` items that pass the absolute paths to the job."""
        return [f"{p.key}={p.path}" for p in self.paths]

    @property
    def env(self) -> dict[str, str]:
        """What the job's driver reads to check the paths (`check_submitted_paths`)."""
        data = {"host": socket.gethostname(), "paths": [[p.key, p.path, p.token] for p in self.paths]}
        return {SUBMITTED_PATHS_ENV: json.dumps(data)}


def _relative(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not is_uri(value) and not Path(value).is_absolute())


def pin_relative_paths(data: Mapping[str, Any], spec: JobSpec) -> Pinned:
    """Resolve the job's relative local paths (in the raw job data `data`) to the absolute paths `spec`
    holds, and write a marker into each directory (created here, on the submitting machine)."""
    run = data.get("run") or {}
    checkpointing = data.get("checkpointing") or {}
    storage = run.get("storage")
    storage_uri = storage.get("uri") if isinstance(storage, Mapping) else storage
    token = secrets.token_hex(8)
    dirs: list[tuple[str, Path]] = []
    # An object store holds what the run keeps: its local directories may stay on the cluster's nodes.
    scratch = storage_uri is not None and is_uri(storage_uri)
    if _relative(run.get("dir")) and not scratch:  # also the default runs/<name>
        dirs.append(("run.dir", spec.run_dir))
    if checkpointing.get("dir") is not None and _relative(checkpointing["dir"]):
        checkpoint_dir = spec.checkpoint_dir
        assert isinstance(checkpoint_dir, Path)
        dirs.append(("checkpointing.dir", checkpoint_dir))
    if storage_uri is not None and _relative(storage_uri):
        assert spec.train.run.storage is not None
        key = "run.storage.uri" if isinstance(storage, Mapping) else "run.storage"
        dirs.append((key, Path(spec.train.run.storage.uri)))
    if (
        checkpointing.get("export_hf_dir") is not None
        and _relative(checkpointing["export_hf_dir"])
        and not scratch
    ):
        export_dir = spec.train.checkpointing.export_hf_dir
        assert export_dir is not None
        dirs.append(("checkpointing.export_hf_dir", export_dir))
    pinned = []
    for key, path in dirs:
        path.mkdir(parents=True, exist_ok=True)
        (path / MARKER).write_text(token)
        pinned.append(PinnedPath(key, str(path), token))
    resume_from = run.get("resume_from")
    if resume_from is not None and _relative(resume_from):
        assert spec.train.run.resume_from is not None
        pinned.append(PinnedPath("run.resume_from", str(spec.train.run.resume_from), ""))
    return Pinned(tuple(pinned))


def check_submitted_paths() -> None:
    """On the cluster: refuse a job whose submitted local paths this machine cannot see."""
    raw = os.environ.get(SUBMITTED_PATHS_ENV)
    if not raw:
        return
    data = json.loads(raw)
    here = socket.gethostname()
    for key, path, token in data["paths"]:
        marker = Path(path) / MARKER
        seen = Path(path).exists() if not token else marker.is_file() and marker.read_text() == token
        if not seen:
            raise ConfigError(
                f"{key} was relative and was resolved on the submitting machine ({data['host']}) to {path}, "
                f"which the cluster ({here}) cannot see. Put it on storage both share (an NFS mount at the "
                "same path), give an absolute path that exists on the cluster nodes, or set run.storage to "
                "an object store URI (s3://..., gs://...): checkpoints, the run summary, the tracker's files "
                "and the export then land there, and run.dir stays on the cluster's nodes."
            )
