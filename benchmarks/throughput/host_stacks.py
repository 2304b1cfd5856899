"""Where a rank's host time goes inside the training step, from `py-spy record -f raw` output.

    python benchmarks/throughput/host_stacks.py PROFILE.txt[.gz] ROOT_FRAME [--top 60]

For each process whose samples contain ROOT_FRAME (d9d: `Trainer._run_step`, torchtitan:
`Trainer.train_step`), prints the share of the step's samples under each frame (inclusive) and at each leaf
(self), leaving out compilation (stacks through dynamo's frame conversion). Only the thread that runs the
step is counted: backward runs on autograd's own thread, whose stacks do not pass through ROOT_FRAME.
`py-spy record --subprocesses` names each process in the stack (`process PID:"cmdline"`); the innermost one
is the process sampled.

`--threads` (for `py-spy record --threads --gil`, as `benchmarks/multi_gpu.py --py-spy` records): per
process that runs ROOT, the samples of each thread (`thread (TID): NAME` in the stack), those of them under
ROOT, and each thread's most frequent innermost frames. Under `--gil` a thread is sampled only while it holds
the GIL, so the other threads' counts are the time they took it from the step's thread (a step that waits
on the GPU many times per step, such as the expert-parallel exchange's host reads, feels each of them).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class StepSamples:
    total: int = 0
    inclusive: collections.Counter[str] = field(default_factory=collections.Counter)
    leaf: collections.Counter[str] = field(default_factory=collections.Counter)


def _frame(text: str) -> str:
    return re.sub(r":\d+\)", ")", text)  # one entry per function, whatever the line


def _start_up(frames: list[str]) -> bool:
    """Imports and compilation (dynamo's, and Triton's of a kernel's first call): start-up, not the steps the
    table times."""
    return any(
        "convert_frame.py" in fr or "<frozen importlib" in fr or "triton/compiler/" in fr for fr in frames
    )


def _sample(line: str) -> tuple[list[str], str, int] | None:
    """One raw line: (its frames, root first; the sampled process, `process PID`; its count), or None for a
    line without a process or a count, or from start-up."""
    stack, _, count = line.rstrip("\n").rpartition(" ")
    frames = stack.split(";")
    processes = [fr for fr in frames if fr.startswith("process ")]
    if not processes or not count.isdigit() or _start_up(frames):
        return None
    return frames, processes[-1].split(":")[0], int(count)


def step_samples(lines: Iterable[str], root: str) -> dict[str, StepSamples]:
    """Per process: the samples under `root`, by frame (each counted once per stack) and by leaf."""
    out: dict[str, StepSamples] = collections.defaultdict(StepSamples)
    for line in lines:
        if (sample := _sample(line)) is None:
            continue
        frames, process, n = sample
        starts = [i for i, fr in enumerate(frames) if fr.startswith(root + " ")]
        if not starts:
            continue
        samples = out[process]
        samples.total += n
        for name in {_frame(fr) for fr in frames[starts[0] :]}:
            samples.inclusive[name] += n
        samples.leaf[_frame(frames[-1])] += n
    return dict(out)


@dataclass
class ThreadSamples:
    total: int = 0
    in_step: int = 0  # under ROOT
    leaf: collections.Counter[str] = field(default_factory=collections.Counter)


def thread_samples(lines: Iterable[str], root: str) -> dict[str, dict[str, ThreadSamples]]:
    """Per process that ran `root` at least once: its samples by thread (`NAME (TID)`, or the TID), leaving
    out imports and compilation."""
    out: dict[str, dict[str, ThreadSamples]] = collections.defaultdict(
        lambda: collections.defaultdict(ThreadSamples)
    )
    for line in lines:
        if (sample := _sample(line)) is None:
            continue
        frames, process, n = sample
        threads = [fr for fr in frames if fr.startswith("thread (")]
        if not threads:
            continue
        tid, _, name = threads[-1].removeprefix("thread ").partition(": ")
        samples = out[process][f"{name} {tid}" if name else tid]
        samples.total += n
        if any(fr.startswith(root + " ") for fr in frames):
            samples.in_step += n
        if frames[-1] is not threads[-1]:
            samples.leaf[_frame(frames[-1])] += n
    return {
        pid: dict(by_thread) for pid, by_thread in out.items() if any(t.in_step for t in by_thread.values())
    }


def _open(path: str) -> TextIO:
    """py-spy's raw text, or its gzip (as `benchmarks/multi_gpu.py --py-spy` keeps it)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rt", errors="replace")
    return open(path, errors="replace")


def _frames_like(path: str, root: str, limit: int = 5) -> list[str]:
    """The most frequent frame names that contain `root` (what the user probably meant)."""
    names: collections.Counter[str] = collections.Counter()
    with _open(path) as f:
        for line in f:
            for fr in line.rpartition(" ")[0].split(";"):
                if root in fr:
                    names[fr.split(" (")[0]] += 1
    return [name for name, _ in names.most_common(limit)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("profile")
    parser.add_argument("root")
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("--threads", action="store_true", help="samples per thread (module docs)")
    args = parser.parse_args()
    per_process: dict[str, dict[str, ThreadSamples]] = {}
    found: dict[str, StepSamples] = {}
    with _open(args.profile) as f:
        if args.threads:
            per_process = thread_samples(f, args.root)
        else:
            found = step_samples(f, args.root)
    if not per_process and not found:  # the root names no frame of any sample
        like = _frames_like(args.profile, args.root)
        raise SystemExit(
            f"no sample of {args.profile} runs a frame named {args.root!r} (the name py-spy prints, "
            f"e.g. 'Trainer._run_step'); frames containing it: {like or 'none'}"
        )
    for pid, by_thread in per_process.items():
        print(f"== {pid}")
        for name, t in sorted(by_thread.items(), key=lambda item: -item[1].total):
            leaves = ", ".join(f"{leaf[:80]} {n}" for leaf, n in t.leaf.most_common(3))
            print(f"{t.total:8d} {t.in_step:8d} in step  {name[:60]}  {leaves}")
    for pid, s in sorted(found.items(), key=lambda item: -item[1].total):
        print(f"== {pid}: {s.total} step samples")
        for key, v in s.inclusive.most_common(args.top):
            print(f"{100 * v / s.total:6.1f}% {key[:160]}")
        print("-- leaves")
        for key, v in s.leaf.most_common(25):
            print(f"{100 * v / s.total:6.1f}% {key[:160]}")


if __name__ == "__main__":
    main()
