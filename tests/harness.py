"""Run a test body on N gloo ranks, each in its own process.

- Processes come from a forkserver that has torch and d9d preloaded, so a rank starts in well under a second.
- Ranks rendezvous through a FileStore in a per-run temp dir (no ports, no races) which they also share.
- A hard timeout: when it expires every live rank dumps its Python stack (faulthandler on SIGUSR1), the
  ranks are killed, and the failure shows each rank's stack, so a hang fails fast and says where.
- The first failing rank's traceback is reported as `rank N failed`; ranks stuck in collectives waiting for
  it are killed after a short grace period.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_GRACE_S = 5.0


class DistributedTestFailure(AssertionError):
    """A rank raised, died, or the run timed out."""


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    tmp_dir: Path


_CTX: Any = None

# Imported once by the forkserver instead of by every rank process (about 2 s of CPU each, most of a short
# run's start-up on a 2-core machine). Importing them starts no thread, initializes no CUDA and reads no
# environment variable (a rank's RANK/WORLD_SIZE are set before the body runs), so a forked rank is in the
# state a fresh import would leave it in. The forkserver imports from the working directory and environment
# the ranks inherit from it; one that raises ImportError is skipped there and imported by each rank as before.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "pytest",  # test modules, which the ranks import to find their body, import it
    "d9d.engine.launch",
    "d9d.models",
    "d9d.parallel",
    "d9d.pipeline.runtime.executor",
]


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _resolve(ref: tuple[str, str] | Callable[..., Any]) -> Callable[..., Any]:
    if callable(ref):
        return ref
    module, name = ref
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj.__d9d_body__ if hasattr(obj, "__d9d_body__") else obj


def _child(
    ref: Any,
    rank: int,
    world_size: int,
    tmp_dir: str,
    args: tuple[Any, ...],
    results: Any,
    init_pg: bool,
    pg_timeout_s: float,
    store_name: str,
    backend: str,
) -> None:
    stack_file = open(Path(tmp_dir) / f".stack-rank{rank}.txt", "w")  # noqa: SIM115 - lives with the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)  # segfaults and aborts leave their stack too
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    import torch.distributed as dist

    try:
        if init_pg:
            store = dist.FileStore(str(Path(tmp_dir) / store_name), world_size)
            timeout = datetime.timedelta(seconds=pg_timeout_s)
            if backend == "nccl":
                import torch

                device = torch.device("cuda", rank)
                torch.cuda.set_device(device)
                dist.init_process_group(
                    "cuda:nccl,cpu:gloo",
                    store=store,
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                    device_id=device,
                )
            else:
                dist.init_process_group(
                    "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
                )
        _resolve(ref)(RankEnv(rank, world_size, Path(tmp_dir)), *args)
        results.put(("ok", rank, ""))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if init_pg and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _read_stacks(tmp_dir: Path, ranks: list[int]) -> str:
    parts = []
    for r in ranks:
        path = tmp_dir / f".stack-rank{r}.txt"
        text = path.read_text() if path.exists() else ""
        parts.append(f"--- rank {r} stack ---\n{text.strip() or '(no stack dumped)'}")
    return "\n".join(parts)


def run_distributed(
    fn: Callable[..., Any] | tuple[str, str],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    tmp_dir: str | Path | None = None,
    init_process_group: bool = True,
    backend: str = "gloo",
) -> None:
    """Run `fn(RankEnv, *args)` on `world_size` ranks; raise `DistributedTestFailure` on any failure.

    `fn` must be importable by name (a module-level function), because ranks are separate processes.
    `backend="nccl"` gives rank r GPU r and a `cuda:nccl,cpu:gloo` default group (GPU tests).
    """
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size must be in [1, 8], got {world_size}")
    ctx = _context()
    owned_tmp = None
    if tmp_dir is None:
        owned_tmp = tempfile.TemporaryDirectory(prefix="d9d-dist-")
        tmp_dir = owned_tmp.name
    tmp = Path(tmp_dir)
    results = ctx.Queue()
    # Collectives give up a little before the harness does, so a rank stuck on a dead peer raises on its own.
    pg_timeout_s = max(5.0, timeout - 2.0)
    # A fresh store file per run: runs may share `tmp_dir`, and a FileStore file outlives its run.
    store_name = f".rendezvous-{uuid.uuid4().hex}"
    procs = [
        ctx.Process(
            target=_child,
            args=(
                fn,
                rank,
                world_size,
                str(tmp),
                args,
                results,
                init_process_group,
                pg_timeout_s,
                store_name,
                backend,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        _collect(procs, results, tmp, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        if owned_tmp is not None:
            owned_tmp.cleanup()


def _collect(procs: list[Any], results: Any, tmp: Path, timeout: float) -> None:
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    reported: dict[int, str | None] = {}  # rank -> traceback (None when it passed)
    first_error_at: float | None = None

    def record(status: str, rank: int, text: str) -> None:
        nonlocal first_error_at
        reported[rank] = text if status == "error" else None
        if status == "error" and first_error_at is None:
            first_error_at = time.monotonic()

    while len(reported) < world_size:
        now = time.monotonic()
        if first_error_at is not None and now - first_error_at > _GRACE_S:
            break
        if now > deadline:
            alive = [r for r, p in enumerate(procs) if r not in reported and p.is_alive()]
            for r in alive:
                os.kill(procs[r].pid, signal.SIGUSR1)
            time.sleep(1.0)
            raise DistributedTestFailure(
                f"timed out after {timeout:.0f}s; ranks still running: {alive}\n{_read_stacks(tmp, alive)}"
            )
        try:
            record(*results.get(timeout=0.2))
            continue
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if r not in reported and not p.is_alive()]
        if dead:
            time.sleep(0.5)  # a rank that reported just before exiting: let its message arrive
            while True:
                try:
                    record(*results.get_nowait())
                except queue.Empty:
                    break
            for r in dead:
                if r not in reported:
                    stack = _read_stacks(tmp, [r])
                    record(
                        "error",
                        r,
                        f"rank {r} exited with code {procs[r].exitcode} without reporting\n{stack}",
                    )
    # dicts keep insertion order: the first error to arrive is the cause, later ones are usually peers
    # failing in a collective with the dead rank.
    errors = {r: text for r, text in reported.items() if text is not None}
    if errors:
        first = next(iter(errors))
        others = "".join(f"\n--- rank {r} also failed ---\n{errors[r]}" for r in errors if r != first)
        raise DistributedTestFailure(f"rank {first} failed:\n{errors[first]}{others}")


def distributed(
    world_size: int, *, timeout: float = 90.0
) -> Callable[[Callable[..., Any]], Callable[[], None]]:
    """Decorator form: the decorated function becomes a pytest test running its body on `world_size` ranks."""

    def decorate(body: Callable[..., Any]) -> Callable[[], None]:
        ref = (body.__module__, body.__qualname__)

        def test() -> None:
            run_distributed(ref, world_size, timeout=timeout)

        test.__name__ = body.__name__
        test.__qualname__ = body.__qualname__
        test.__module__ = body.__module__
        test.__doc__ = body.__doc__
        test.__d9d_body__ = body  # type: ignore[attr-defined]
        return test

    return decorate
