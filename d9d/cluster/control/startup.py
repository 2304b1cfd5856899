"""Where a launch's start-up goes: from `d9d train` (or `TrainingJob.start`) to the first step completed,
cut into phases, each ending where the next begins:

- `launch`: the driver before Ray: the interpreter and its imports, the config, the preflight (from the
  process's start under `d9d train`/`d9d resume`; from `TrainingJob.start` in a notebook);
- `ray`: starting a local Ray instance, or joining the cluster;
- `coordinator`: the launch lease, the coordinator actor's process and imports, until it runs;
- `place`: reserving the placement group, picking the checkpoint to resume from;
- `actors`: starting the rank actors (their processes and imports) and the rendezvous store;
- `tracker`: opening the tracker (an MLflow store), when that takes longer than the ranks;
- `process_group`: until rank 0's process group is ready;
- `build`: rank 0 builds the model, optimizer and data (until it asks for the latest checkpoint);
- `load`: rank 0 loads the checkpoint (nothing on a fresh run) until its first step boundary;
- `first_step`: the first step, with compilation and warm-up, until the coordinator has seen it.

The coordinator keeps one clock per launch (its first attempt; a restart's phases are the recovery's,
`d9d.cluster.control.recovery`). `d9d train`'s console prints each phase as it ends, the bar shows the one
in progress, and `run_summary.json` records them (`startup_s`). Times are wall-clock seconds, the only clock
the driver, the coordinator and the ranks share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = (
    "launch",
    "ray",
    "coordinator",
    "place",
    "actors",
    "tracker",
    "process_group",
    "build",
    "load",
    "first_step",
)
# What the console says of each phase.
LABELS = {
    "launch": "driver (imports, config, preflight)",
    "ray": "Ray",
    "coordinator": "coordinator actor",
    "place": "placement group",
    "actors": "rank actors (processes, imports)",
    "tracker": "tracker",
    "process_group": "process group",
    "build": "build (model, optimizer, data)",
    "load": "checkpoint load",
    "first_step": "first step (compile, warm-up)",
}
DRIVER_PHASES = ("launch", "ray")  # ended on the driver, whose marks the coordinator is given


@dataclass
class StartupClock:
    """The end (wall clock) of each phase seen so far; `started` is where the first one begins."""

    started: float
    ends: dict[str, float] = field(default_factory=dict)

    def end(self, phase: str, at: float | None = None) -> None:
        """Mark `phase` ended (the first mark of a phase counts)."""
        assert phase in PHASES, phase
        self.ends.setdefault(phase, time.time() if at is None else at)

    @property
    def done(self) -> bool:
        return PHASES[-1] in self.ends

    def phases(self) -> dict[str, float]:
        """Seconds per phase, in order, up to the last one that ended. A phase with no mark (the tracker was
        ready before the ranks; a notebook has no `launch`) is left out and its time goes to the next one;
        one ending before the previous (clock skew between nodes) takes 0."""
        out: dict[str, float] = {}
        prev = self.started
        for phase in PHASES:
            end = self.ends.get(phase)
            if end is None:
                continue
            at = max(end, prev)
            out[phase] = round(at - prev, 3)
            prev = at
        return out

    def current(self) -> tuple[str, float] | None:
        """The phase in progress and since when (None once the first step was seen)."""
        if self.done:
            return None
        ended = [p for p in PHASES if p in self.ends]
        last = PHASES.index(ended[-1]) if ended else -1
        optional = {"tracker", "launch"}
        following = [p for p in PHASES[last + 1 :] if p not in optional]
        since = self.ends[ended[-1]] if ended else self.started
        return (following[0] if following else PHASES[-1]), since


def describe(phases: dict[str, float]) -> str:
    """`14.2s: Ray 3.1s, coordinator actor 1.2s, ...` for the console's closing start-up line."""
    total = sum(phases.values())
    return f"{total:.1f}s: " + ", ".join(f"{p} {s:.1f}s" for p, s in phases.items())
