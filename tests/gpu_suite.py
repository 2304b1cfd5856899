"""The `gpu` tests on one N-GPU host, spread over its GPUs.

    python -m tests.gpu_suite [--out DIR] [--groups 1,2,4,ray] [--per-block K] [extra pytest args]

Tests are grouped by the GPUs they need (`gpu`: 1, `gpu` + `gpus(n)`: n). Each group runs as `N // n` pytest
processes at once, each seeing its own block of n GPUs (`CUDA_VISIBLE_DEVICES`), tests dealt to the
processes round-robin; groups run one after the other, smallest n first. `--per-block K` runs K processes on
each block at once: the tests' models are small enough that one leaves most of an H200 idle (a 2-GPU engine
layout uses a few hundred MB and waits on its compile and its torchrun start-up), so K of them share a block
and the host's cores; no test here times itself, so sharing changes no result.

Tests that start Ray (`ray`) run last, in one process that sees every GPU (their placement tests reserve GPUs
themselves). A group that needs more GPUs than present still runs, once, so its tests report the skip with
the count.

Each process's output goes to `DIR/gpu-suite-<n>gpu-<i>.log` (default: a temporary directory); every test's
outcome by name (pytest's `-rA` summary, skip reasons included) and each process's last line are printed
and collected in `DIR/summary.txt`. Exits non-zero when any process fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RAY = 0
"""Group key of the Ray tests (run last, on every GPU)."""


class _Collector:
    """A pytest plugin recording each `gpu` test's group: the GPUs it needs, or RAY."""

    def __init__(self) -> None:
        self.groups: dict[int, list[str]] = {}

    def pytest_collection_finish(self, session: Any) -> None:
        # after `-k` / `-m` deselection (collection_modifyitems may run before it): the dealing then
        # spreads only the selected tests over the processes
        for item in session.items:
            if item.get_closest_marker("gpu") is None:
                continue
            marker = item.get_closest_marker("gpus")
            key = RAY if item.get_closest_marker("ray") else (marker.args[0] if marker else 1)
            self.groups.setdefault(key, []).append(item.nodeid)


def _deal(node_ids: list[str], bins: int) -> list[list[str]]:
    """Tests dealt round-robin in collection order, so a file's cases spread over the processes: one file
    (the 2-GPU engine layouts, six minutes) would otherwise hold a whole group up while other GPUs idle.
    Each case launches its own ranks, so nothing is shared within a file that dealing could lose."""
    out: list[list[str]] = [[] for _ in range(max(bins, 1))]
    for i, node in enumerate(node_ids):
        out[i % len(out)].append(node)
    return [b for b in out if b]


def _outcomes(path: Path) -> str:
    """Every test's outcome line of pytest's short summary (`-rA`: PASSED/FAILED/ERROR/SKIPPED with the node
    id or the skip reason) and its last line, whatever the process printed before them."""
    lines = path.read_text(errors="replace").splitlines()
    named = [
        ln for ln in lines if ln.startswith(("PASSED ", "FAILED ", "ERROR ", "SKIPPED ", "XFAIL", "XPASS"))
    ]
    return "\n".join([*named, *lines[-1:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_suite")
    parser.add_argument("--out", type=Path, default=None, help="where the per-process logs go")
    parser.add_argument(
        "--groups", default=None, help="comma-separated groups to run: GPU counts and/or 'ray' (default: all)"
    )
    parser.add_argument(
        "--per-block", type=int, default=1, help="pytest processes sharing each block of GPUs at once"
    )
    args, extra = parser.parse_known_args(argv)
    if args.per_block < 1:
        parser.error(f"--per-block {args.per_block}: at least 1 pytest process per block")
    import pytest
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("no CUDA device: nothing to run")
        return 1
    collector = _Collector()
    pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests", *extra], plugins=[collector])
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text("")
    # -rA: each test's outcome by name in the short summary, which `_outcomes` prints and `summary.txt` keeps
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *extra]
    failed = False
    start = time.monotonic()
    wanted = None if args.groups is None else {RAY if g == "ray" else int(g) for g in args.groups.split(",")}
    for need in sorted(collector.groups, key=lambda k: (k == RAY, k)):
        if wanted is not None and need not in wanted:
            continue
        width = gpus if need == RAY else need
        blocks = max(gpus // width, 1)
        # the Ray tests reserve every GPU of the host themselves: never shared
        sharing = 1 if need == RAY else args.per_block
        procs = []
        for i, nodes in enumerate(_deal(collector.groups[need], blocks * sharing)):
            log = out / f"gpu-suite-{'ray' if need == RAY else f'{need}gpu'}-{i}.log"
            block = i % blocks
            devices = ",".join(str(d) for d in range(block * width, min((block + 1) * width, gpus)))
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices}
            with log.open("w") as sink:
                procs.append(
                    (
                        log,
                        subprocess.Popen([*command, *nodes], env=env, stdout=sink, stderr=subprocess.STDOUT),
                    )
                )
        for log, proc in procs:
            failed |= proc.wait() != 0
            outcome = f"== {log.name} ==\n{_outcomes(log)}\n"
            print(outcome, flush=True)
            with (out / "summary.txt").open("a") as summary:  # one file: a device call returns few
                summary.write(outcome + "\n")
        print(
            f"-- {'Ray' if need == RAY else f'{need}-GPU'} group done at {time.monotonic() - start:.0f} s",
            flush=True,
        )
    print(f"total: {time.monotonic() - start:.0f} s; logs in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
