"""Random access to the documents of one or more text files, without loading them.

One pass over the files at construction records each document's byte span (16 bytes per document); a
document is then read with a single `pread`. Random access is what lets the shuffling and sharding layers
above address any document directly, and it keeps memory flat however large the corpus is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from d9d.data.sources.formats import DocumentFormat
from d9d.data.state import check_state_matches


class FileDocuments:
    """`docs[i]` is the text of document `i`, counting through `paths` in order."""

    def __init__(self, paths: Path | str | Sequence[Path | str], fmt: DocumentFormat) -> None:
        self.paths = [Path(p) for p in ([paths] if isinstance(paths, str | Path) else paths)]
        if not self.paths:
            raise ValueError("no data files given")
        for path in self.paths:
            if not path.is_file():
                raise FileNotFoundError(f"data file {path} does not exist")
        self.format = fmt
        file_ids: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        for file_id, path in enumerate(self.paths):
            with path.open("rb") as stream:
                for start, end in fmt.spans(stream, str(path)):
                    file_ids.append(file_id)
                    starts.append(start)
                    ends.append(end)
        if not starts:
            raise ValueError(f"no documents found in {[str(p) for p in self.paths]} ({fmt.describe()})")
        self._file_ids = np.asarray(file_ids, dtype=np.int32)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._ends = np.asarray(ends, dtype=np.int64)
        self._sizes = [path.stat().st_size for path in self.paths]
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def _fd(self, file_id: int) -> int:
        fd = self._fds.get(file_id)
        if fd is None:
            fd = self._fds[file_id] = os.open(self.paths[file_id], os.O_RDONLY)
        return fd

    def raw(self, index: int) -> bytes:
        if not -len(self) <= index < len(self):
            raise IndexError(f"document {index} out of range for {len(self)} documents")
        file_id, start, end = int(self._file_ids[index]), int(self._starts[index]), int(self._ends[index])
        return os.pread(self._fd(file_id), end - start, start)

    def __getitem__(self, index: int) -> str:
        return self.format.text(self.raw(index))

    def byte_length(self, index: int) -> int:
        return int(self._ends[index] - self._starts[index])

    # Worker processes get a copy without open descriptors; they open their own on first access.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}}

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "files": [[p.name, size] for p, size in zip(self.paths, self._sizes, strict=True)],
            "format": self.format.describe(),
            "documents": len(self),
        }

    def state_dict(self) -> dict[str, Any]:
        return self._fingerprint()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Positions are indices, so a resume is only exact over the same files in the same format."""
        check_state_matches("documents", state, self._fingerprint())
