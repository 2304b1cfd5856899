"""Writing a file so that a reader sees the old content or the new one, never a torn mix."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: Path, write: Callable[[BinaryIO], None], *, fsync: bool = False) -> None:
    """Calls `write` on a temporary file beside `path`, then renames it over `path`.

    The temporary name is unique per call (pid and a random part), so two processes or two threads of one
    process writing the same target never share one; the last rename wins. With
    `fsync`, the data reaches the disk before the rename makes it visible (a crash then leaves the old file
    or the complete new one, not an empty one).
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        with tmp.open("wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = False) -> None:
    atomic_write(path, lambda f: f.write(data), fsync=fsync)  # type: ignore[arg-type,return-value]


def atomic_write_text(path: Path, text: str, *, fsync: bool = False) -> None:
    atomic_write_bytes(path, text.encode(), fsync=fsync)
