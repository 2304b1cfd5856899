"""The Ray task that reads a hung rank's state on its node: its threads' stacks and its last collectives.

It runs in a fresh Ray worker on the rank's node, so this module imports no torch and no engine (a cold
import of those takes seconds, more on a loaded node, all of it before the dump can start): the stacks
come from the rank's own `faulthandler`, the collectives from its flight-recorder socket
(`d9d.core.flight_recorder`, whose reading side needs only the standard library).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from d9d.core import flight_recorder

STACKS_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class RankDump:
    """What a hung rank gave: its threads' stacks (None: none within the timeout) and its flight
    recorder's snapshot as `Snapshot.to_json` text (one saying why, when it gave none)."""

    stacks: str | None
    collectives: str


_QUIET_S = 1.0


@ray.remote(num_cpus=0)
def dump_rank(pid: int, path: str, signum: int, timeout_s: float) -> RankDump:
    """Have process `pid` dump its stacks into `path` (its faulthandler, registered on `signum`) and read
    them, with py-spy on the node also its dump (native frames included); meanwhile read its last
    collectives from its flight-recorder socket."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        collectives = pool.submit(_fetch_collectives, pid, timeout_s)
        stacks = _dump_stacks(pid, Path(path), signum, timeout_s)
        return RankDump(stacks, collectives.result())


def missing(why: str) -> str:
    """The snapshot text of a rank that gave none."""
    return flight_recorder.Snapshot(missing=why).to_json()


def _fetch_collectives(pid: int, timeout_s: float) -> str:
    try:
        return flight_recorder.fetch(pid, timeout_s).to_json()
    except TimeoutError:
        return missing(f"it did not answer within {timeout_s:.0f}s (frozen, or a thread holds the GIL)")
    except (OSError, ValueError) as e:
        return missing(f"it could not be read: {type(e).__name__}: {e}")


def _dump_stacks(pid: int, stacks: Path, signum: int, timeout_s: float) -> str | None:
    start = stacks.stat().st_size if stacks.exists() else 0
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return None
    deadline = time.monotonic() + timeout_s
    size, stable_since = start, time.monotonic()
    # faulthandler writes in pieces and marks no end: wait until the file stops growing. A rank on a loaded
    # host paused longer than 0.3 s mid-dump (the full test suite on 2 cores), and the cut dump lacked its
    # training thread: 1 s of quiet.
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now_size = stacks.stat().st_size if stacks.exists() else 0
        if now_size != size:
            size, stable_since = now_size, time.monotonic()
        elif size > start and time.monotonic() - stable_since > _QUIET_S:
            break
    text = None
    if size > start:
        with stacks.open("rb") as f:
            f.seek(start)
            text = f.read(size - start).decode(errors="replace")
    spy = shutil.which("py-spy")
    if spy is not None:
        with contextlib.suppress(Exception):
            dump = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s
            )
            if dump.returncode == 0:
                text = f"{text or ''}\n---- py-spy dump ----\n{dump.stdout}"
    return text
