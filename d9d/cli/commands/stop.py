"""`d9d stop RUN`: stop a run found by its name and wait until it ended: its Ray job (`ray job stop`: the
driver, `d9d train`, gets SIGTERM and stops the ranks as below within `cluster.preemption_grace_s`), else its
live coordinator: the ranks stop at the next step boundary and commit that step (killed if they have not
within `--timeout`); `--now` kills them at once, losing the steps since the last commit.

A run launched without Ray (`python -m d9d.engine.launch`, torchrun, a script's `recorded_train`) is
stopped through the process its `run.json` names, rank 0's: SIGTERM has it stop at the next step boundary,
which it saves and commits (d9d.engine.launch), then its end is read from its files; SIGKILL when it has
not ended within `--timeout`, or at once with `--now`. Only on the host it runs on: a pid names a process of
one host."""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psutil

    from d9d.cli.storage import Lookup

_STOP_WAIT_S = 120.0
_KILL_WAIT_S = 10.0  # for a killed process to be gone
# The process a launch without Ray records, by its launcher (d9d.engine.launch.LaunchRecords).
_PROCESS = {"process": "its process", "torchrun": "torchrun's rank 0", "script": "the script's rank 0"}


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.storage import lookup_run, not_found
    from d9d.cluster.lookup import attach

    lookup = lookup_run(args, "stop")
    if lookup is None:
        return 2
    run, loc = lookup.run, lookup.found
    from d9d.engine.run_files import PROCESS_LAUNCHERS

    if loc.record is not None and loc.record.launcher in PROCESS_LAUNCHERS:
        return _stop_process(lookup, now=args.now, timeout_s=args.timeout)
    if loc.submission is not None:
        from d9d.cluster import submit as jobs

        sub, address = loc.submission, jobs.dashboard_address(args.address)
        if not args.now and loc.ray_address is not None:
            # `ray job stop` gives the driver only a few seconds (RAY_JOB_STOP_WAIT_TIME_S) after its
            # SIGTERM: have the coordinator commit the step the ranks are at first, when it is reachable.
            try:
                job = attach(loc)
                if job is not None:
                    summary = job.checkpoint_and_stop(args.timeout, reason="d9d stop")
                    print(f"run {sub.run_name}: {summary.status} after {summary.steps} steps")
            except Exception as e:  # the Ray job stop below still ends it
                print(f"d9d stop: could not stop run {run!r} at a step boundary: {e}", file=sys.stderr)
        print(f"run {sub.run_name}: Ray job {sub.submission_id} {jobs.stop(sub.submission_id, address)}")
        return 0
    job = attach(loc)
    if job is None:
        where = "it has ended" if loc.ended else "no Ray job or live coordinator found"
        if loc.record is None:
            where += f", and {not_found(lookup)}"
        print(f"d9d stop: run {run!r}: {where}", file=sys.stderr)
        return 1
    if args.now:
        job.stop(force=True, reason="d9d stop --now")
        summary = job.result(timeout=_STOP_WAIT_S)
    else:
        print(f"run {run}: stopping at the next step boundary, which is saved", flush=True)
        summary = job.checkpoint_and_stop(args.timeout, reason="d9d stop")
    latest = (
        f"; latest commit: step {job.status().latest_checkpoint_step}" if not job.coordinator_lost else ""
    )
    print(f"run {run}: {summary.status} after {summary.steps} steps{latest}")
    return 0


def _stop_process(lookup: Lookup, *, now: bool, timeout_s: float) -> int:
    """Stop a launch without Ray through its recorded process (rank 0's: under torchrun it hands the stop
    to every rank at the same step boundary); 1, after one line on stderr, when there is none to stop."""
    import psutil

    from d9d.engine.run_files import driver_host_pid, local_process

    run, record, files = lookup.run, lookup.found.record, lookup.found.files
    assert record is not None
    named = driver_host_pid(record.driver)
    if lookup.found.ended or named is None:
        state = files.state if files is not None else "unknown"
        print(f"d9d stop: run {run!r} is not running ({state}; {record.launcher} launch)", file=sys.stderr)
        return 1
    host, pid = named
    here = socket.gethostname()
    if host != here:
        print(
            f"d9d stop: run {run!r} runs as process {pid} on host {host}, not on this one ({here}): "
            f"run d9d stop there (or send that process SIGTERM)",
            file=sys.stderr,
        )
        return 1
    process = local_process(record.driver, record.started_at)
    if process is None:  # gone (or its pid is another, later process's: that one is not signalled)
        print(f"d9d stop: run {run!r} is not running: its process {pid} has ended", file=sys.stderr)
        return 1
    what = f"{_PROCESS.get(record.launcher, 'the process')} (pid {pid})"
    try:
        if now:
            process.kill()  # psutil checks that the pid still names that process first
            print(f"run {run}: killed {what} (SIGKILL); the steps since the last commit are lost", flush=True)
        else:
            process.send_signal(signal.SIGTERM)  # as kill() does, for the same process only
            print(
                f"run {run}: sent SIGTERM to {what}: it stops at the next step boundary, which it saves "
                f"(waiting up to {timeout_s:g}s)",
                flush=True,
            )
            if not _ended(process, timeout_s):
                process.kill()
                print(f"run {run}: not ended within {timeout_s:g}s: killed it (SIGKILL)", flush=True)
    except psutil.NoSuchProcess:
        pass  # it ended on its own meanwhile
    if not _ended(process, _KILL_WAIT_S):
        print(f"d9d stop: run {run!r}: process {pid} is still there", file=sys.stderr)
        return 1
    from d9d.cluster.registry import state_from_files

    ended = state_from_files(record, lookup.options)
    steps = f" after {ended.step} steps" if ended.step is not None else ""
    print(f"run {run}: {ended.state}{steps}")
    return 0


def _ended(process: psutil.Process, timeout_s: float) -> bool:
    """Whether `process` ended within `timeout_s`: it is gone, or a zombie (ended, not yet reaped by its
    parent, such as torchrun's agent)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            # is_running: False too when the pid now names another process
            if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def register(subparsers: Any) -> None:
    from d9d.cli.commands.status import add_lookup_options

    parser = subparsers.add_parser("stop", help="stop a run, found by its name")
    add_lookup_options(parser)
    parser.add_argument(
        "--now",
        action="store_true",
        help="kill the ranks at once (the steps since the last commit are lost) instead of stopping at the "
        "next step boundary with a checkpoint of it (a run without Ray: SIGKILL to its process instead of "
        "SIGTERM)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=_STOP_WAIT_S,
        metavar="S",
        help="kill the ranks if they have not stopped at a step boundary within S seconds "
        f"(default {_STOP_WAIT_S:g})",
    )
    parser.set_defaults(handler=_run)
