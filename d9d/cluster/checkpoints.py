"""The coordinator's side of the checkpoint commit protocol, on top of the engine's on-disk layout.

A step becomes `latest` only after every rank of the attempt reported its files and every file checks out
against its report (size and sha256, read back from the store). In coordinator-storage mode the files
arrive here chunk by chunk through the Ray object store and are served back the same way.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from d9d.engine.checkpoint import (
    MANIFEST,
    CheckpointError,
    commit,
    is_committed,
    read_latest,
    sha256_of,
    step_dir_name,
)
from d9d.engine.runtime import CheckpointFile, RankCheckpointReport


@dataclass(frozen=True)
class CommittedStep:
    step: int
    path: Path
    files: tuple[CheckpointFile, ...]


class CheckpointStore:
    def __init__(self, root: Path, keep_last: int) -> None:
        self.root = root
        self.keep_last = keep_last

    def latest(self) -> CommittedStep | None:
        step_dir = read_latest(self.root)
        if step_dir is None:
            return None
        manifest = json.loads((step_dir / MANIFEST).read_text())
        files = tuple(
            CheckpointFile(rel, int(info["size"]), str(info["sha256"]))
            for rel, info in sorted(manifest["files"].items())
        )
        return CommittedStep(int(manifest["step"]), step_dir, files)

    def commit(self, step: int, reports: Sequence[RankCheckpointReport], world_size: int) -> Path:
        """Verify every rank's report against the stored files, then write the manifest and move `latest`."""
        ranks = sorted(r.rank for r in reports)
        if ranks != list(range(world_size)):
            missing = sorted(set(range(world_size)) - set(ranks))
            raise CheckpointError(f"step {step}: no checkpoint report from rank(s) {missing}")
        step_dir = self.root / step_dir_name(step)
        for report in reports:
            if report.step != step:
                raise CheckpointError(f"rank {report.rank} reported step {report.step} for step {step}")
            for f in report.files:
                path = step_dir / f.relative_path
                if not path.is_file() or path.stat().st_size != f.size_bytes:
                    raise CheckpointError(
                        f"rank {report.rank}: {path} is missing or not {f.size_bytes} bytes"
                    )
                if sha256_of(path) != f.sha256:
                    raise CheckpointError(f"rank {report.rank}: {path} does not match its sha256")
        return commit(self.root, step, reports, self.keep_last)

    def clear_uncommitted(self) -> None:
        """Drop step directories newer than `latest` that never committed (an interrupted attempt's)."""
        latest = read_latest(self.root)
        for path in self.root.glob("step-*"):
            if path.is_dir() and not is_committed(path) and (latest is None or path.name > latest.name):
                shutil.rmtree(path, ignore_errors=True)

    # -- coordinator-storage mode ----------------------------------------------------------------------

    def _file(self, step: int, relative_path: str) -> Path:
        path = (self.root / step_dir_name(step) / relative_path).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise CheckpointError(f"checkpoint file {relative_path!r} escapes the checkpoint directory")
        return path

    def write_chunk(self, step: int, relative_path: str, offset: int, data: bytes) -> None:
        path = self._file(step, relative_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("r+b" if offset > 0 else "wb") as f:
            f.seek(offset)
            f.write(data)

    def read_chunk(self, step: int, relative_path: str, offset: int, size: int) -> bytes:
        with self._file(step, relative_path).open("rb") as f:
            f.seek(offset)
            return f.read(size)
