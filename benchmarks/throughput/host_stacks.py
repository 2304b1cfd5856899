"""Where a rank's host time goes inside the training step, from `py-spy record -f raw` output.

    python benchmarks/throughput/host_stacks.py PROFILE.txt ROOT_FRAME [--top 60]

For each process whose samples contain ROOT_FRAME (d9d: `Trainer._run_step`, torchtitan:
`Trainer.train_step`), prints the share of the step's samples under each frame (inclusive) and at each leaf
(self), leaving out compilation (stacks through dynamo's frame conversion). Only the thread that runs the
step is counted: backward runs on autograd's own thread, whose stacks do not pass through ROOT_FRAME.
`py-spy record --subprocesses` names each process in the stack (`process PID:"cmdline"`); the innermost one
is the process sampled.
"""

from __future__ import annotations

import argparse
import collections
import re
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class StepSamples:
    total: int = 0
    inclusive: collections.Counter[str] = field(default_factory=collections.Counter)
    leaf: collections.Counter[str] = field(default_factory=collections.Counter)


def _frame(text: str) -> str:
    return re.sub(r":\d+\)", ")", text)  # one entry per function, whatever the line


def step_samples(lines: Iterable[str], root: str) -> dict[str, StepSamples]:
    """Per process: the samples under `root`, by frame (each counted once per stack) and by leaf."""
    out: dict[str, StepSamples] = collections.defaultdict(StepSamples)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        starts = [i for i, fr in enumerate(frames) if fr.startswith(root + " ")]
        processes = [fr for fr in frames if fr.startswith("process ")]
        if not starts or not processes or any("convert_frame.py" in fr for fr in frames):
            continue
        samples, n = out[processes[-1].split(":")[0]], int(count)
        samples.total += n
        for name in {_frame(fr) for fr in frames[starts[0] :]}:
            samples.inclusive[name] += n
        samples.leaf[_frame(frames[-1])] += n
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("profile")
    parser.add_argument("root")
    parser.add_argument("--top", type=int, default=60)
    args = parser.parse_args()
    with open(args.profile, errors="replace") as f:
        found = step_samples(f, args.root)
    for pid, s in sorted(found.items(), key=lambda item: -item[1].total):
        print(f"== {pid}: {s.total} step samples")
        for key, v in s.inclusive.most_common(args.top):
            print(f"{100 * v / s.total:6.1f}% {key[:160]}")
        print("-- leaves")
        for key, v in s.leaf.most_common(25):
            print(f"{100 * v / s.total:6.1f}% {key[:160]}")


if __name__ == "__main__":
    main()
