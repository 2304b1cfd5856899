"""One live launch per run: a lease file in the run directory, `<run dir>/launch.lease`.

A launch (`TrainingJob.start`: `d9d train`, `d9d submit`'s driver, `d9d resume`, a notebook) acquires the
lease before its coordinator exists, by creating the file exclusively (`O_CREAT | O_EXCL`: of two launches
at once, exactly one creates it). Its coordinator then renews it every `RENEW_S` with its own host, pid
and Ray address, and deletes it when the run ended. A second launch finds the lease and refuses with the
live launch's address (`LeaseHeld`), unless its owner is dead:

- its last renewal is older than `STALE_S` (a coordinator that died, on any host, in any Ray cluster);
- its owner's process is on this host and no longer exists;
- its owner is a coordinator in the Ray cluster this launch joined, and no live coordinator of the run is
  there (the head was restarted, the actor was killed).

A dead owner's lease is taken over: renamed aside, then created afresh. Judging a lease and taking it
over (and renewing one) happen under an exclusive `flock` of `<run dir>/.launch.lease.lock`, so of several
launches that found the same stale lease only the first replaces it. A coordinator that finds its lease
taken over by another launch (it was too slow to renew for `STALE_S`) ends its run (`LeaseLost`) rather
than train beside the other.

Renewal times are wall clock: on several hosts their clocks must agree to within a fraction of `STALE_S`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from d9d.core.files import atomic_write_text

LEASE_FILE = "launch.lease"
LOCK_FILE = ".launch.lease.lock"
RENEW_S = 2.0
STALE_S = 20.0
_log = logging.getLogger(__name__)


class Lease(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    run_name: str
    launch_id: str
    owner: Literal["driver", "coordinator"]  # the driver holds it until its coordinator renews it
    host: str
    pid: int
    ray_address: str = ""  # the Ray cluster (GCS address) of the launch
    acquired_at: float
    renewed_at: float

    def describe(self, now: float | None = None) -> str:
        age = (now if now is not None else time.time()) - self.renewed_at
        where = f" in the Ray cluster at {self.ray_address}" if self.ray_address else ""
        return (
            f"launch {self.launch_id} ({self.owner} pid {self.pid} on {self.host}{where}, lease renewed "
            f"{age:.0f}s ago)"
        )


class LeaseHeld(RuntimeError):
    """Another launch of the run is live."""

    def __init__(self, lease: Lease, run_dir: Path) -> None:
        self.lease = lease
        attach = f"d9d status {lease.run_name}" + (
            f" --address {lease.ray_address}" if lease.ray_address else ""
        )
        super().__init__(
            f"run {lease.run_name} is already running: {lease.describe()}; see it with `{attach}`, stop it "
            f"first, or pick another run.name/run.dir. ({run_dir / LEASE_FILE} is taken over once it is "
            f"{STALE_S:g}s old)"
        )


class LeaseLost(RuntimeError):
    """This launch's lease was taken over by another launch."""


def lease_path(run_dir: Path) -> Path:
    return run_dir / LEASE_FILE


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    """Hold the run's lease lock (processes and threads each open their own description: they exclude
    each other)."""
    fd = os.open(run_dir / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def read_lease(run_dir: Path) -> Lease | None:
    """The run's lease; None when there is none. A damaged file reads as a lease of nobody (stale)."""
    try:
        text = lease_path(run_dir).read_text()
    except FileNotFoundError:
        return None
    try:
        return Lease.model_validate(json.loads(text))
    except (ValueError, ValidationError):
        _log.warning("%s is damaged; it is taken over", lease_path(run_dir))
        return Lease(
            run_name="?", launch_id="?", owner="driver", host="?", pid=0, acquired_at=0.0, renewed_at=0.0
        )


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def owner_alive(
    lease: Lease, now: float, *, coordinator_running: Callable[[Lease], bool | None] | None = None
) -> bool:
    """Whether the launch holding `lease` may still be running (see the module's rules).
    `coordinator_running` answers for a coordinator owner from the Ray cluster this launch joined (None:
    that cluster cannot tell, e.g. it is another one)."""
    if now - lease.renewed_at > STALE_S:
        return False
    if lease.host == socket.gethostname() and not _pid_alive(lease.pid):
        return False
    if lease.owner == "coordinator" and coordinator_running is not None:
        return coordinator_running(lease) is not False
    return True


def acquire(
    run_dir: Path,
    run_name: str,
    launch_id: str,
    *,
    ray_address: str = "",
    coordinator_running: Callable[[Lease], bool | None] | None = None,
) -> Lease:
    """Take the run's lease for `launch_id` (held by this process until its coordinator renews it).
    Raises `LeaseHeld` when a live launch holds it; a dead one's is taken over, with a warning."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with _locked(run_dir):
        return _acquire(run_dir, run_name, launch_id, ray_address, coordinator_running)


def _acquire(
    run_dir: Path,
    run_name: str,
    launch_id: str,
    ray_address: str,
    coordinator_running: Callable[[Lease], bool | None] | None,
) -> Lease:
    path = lease_path(run_dir)
    for _ in range(5):
        now = time.time()
        mine = Lease(
            run_name=run_name,
            launch_id=launch_id,
            owner="driver",
            host=socket.gethostname(),
            pid=os.getpid(),
            ray_address=ray_address,
            acquired_at=now,
            renewed_at=now,
        )
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            held = read_lease(run_dir)
            if held is None:
                continue  # released meanwhile
            if held.launch_id == launch_id:
                return held
            if owner_alive(held, now, coordinator_running=coordinator_running):
                raise LeaseHeld(held, run_dir) from None
            aside = path.with_name(f".{LEASE_FILE}.stale-{uuid.uuid4().hex[:12]}")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            aside.unlink(missing_ok=True)
            _log.warning(
                "run %s: taking over the lease of a launch that is gone: %s", run_name, held.describe(now)
            )
            continue
        with os.fdopen(fd, "w") as f:
            f.write(mine.model_dump_json())
        return mine
    raise RuntimeError(f"{path}: could not take the run's lease (other launches keep changing it)")


def renew(
    run_dir: Path, lease: Lease, *, owner: Literal["driver", "coordinator"], host: str, pid: int
) -> Lease:
    """Renew this launch's lease (taking it over from its driver: `owner`, `host`, `pid`). Raises
    `LeaseLost` when the file now belongs to another launch."""
    with _locked(run_dir):
        held = read_lease(run_dir)
        if held is None or held.launch_id != lease.launch_id:
            other = "nobody" if held is None else held.describe()
            raise LeaseLost(
                f"run {lease.run_name}: the lease of launch {lease.launch_id} is now held by {other}"
            )
        update = {"owner": owner, "host": host, "pid": pid, "renewed_at": time.time()}
        renewed = lease.model_copy(update=update)
        atomic_write_text(lease_path(run_dir), renewed.model_dump_json())
        return renewed


def release(run_dir: Path, launch_id: str) -> None:
    """Give the lease back (only when it is still this launch's)."""
    if not run_dir.is_dir():
        return
    with _locked(run_dir):
        held = read_lease(run_dir)
        if held is not None and held.launch_id == launch_id:
            with contextlib.suppress(FileNotFoundError):
                lease_path(run_dir).unlink()


def check_no_live_launch(run_dir: Path) -> None:
    """Raise `LeaseHeld` when the run directory (as this machine sees it) holds a live launch's lease."""
    held = read_lease(run_dir)
    if held is not None and owner_alive(held, time.time()):
        raise LeaseHeld(held, run_dir)
