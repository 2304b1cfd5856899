"""Which rank a hung attempt waits for, from every rank's Python stacks.

When an attempt is declared hung (no step for `step_timeout_s`, a rank's heartbeats stopped), the coordinator
has each rank dump its threads' stacks (`faulthandler`, registered on SIGUSR1 by every rank actor, so a
rank stuck in C code or holding the GIL dumps too; `py-spy dump` where it is installed) before the ranks are
torn down. `attribute` reads the training thread of each rank (the one running `RankActor._run`):

- a rank that is not inside a `torch.distributed` collective is *behind*: the others wait for it; its
  innermost frame says where it is (the line of the `time.sleep`, the data loader, a compiled region);
- ranks that all wait in collectives, but not in the same one at the same line, disagree: a rank skipped
  (or added) a collective, and the odd ones out are named;
- a rank that gave no stacks (its process is frozen, e.g. SIGSTOP, or stuck in the kernel) is behind.

With each rank's flight-recorder snapshot (`d9d.core.flight_recorder`: its last collectives, gloo's and
NCCL's, read from a socket the rank serves) the report also names each rank's last completed and oldest
pending collective, and the rank whose collective sequence number lags in a group, or the collective number
at which the ranks recorded different ops. On NCCL this is what tells a hang apart: the training thread
only enqueues the collectives, so its stack shows where it blocked later, not which collective never
completed.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from d9d.core.flight_recorder import Collective, Lag, Snapshot, lagging

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_PYSPY_FRAME = re.compile(r"^\s+(?P<func>\S+) \((?P<file>[^:]+):(?P<line>\d+)\)")
_COLLECTIVE_FILES = ("torch/distributed/",)
_ENTRY = ("d9d/cluster/rank.py", "_run")
_WRAPPERS = frozenset({"wrapper", "inner", "_fn", "decorated", "wrapped"})


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.func}"


def threads(dump: str) -> list[list[Frame]]:
    """The threads of a faulthandler (or py-spy) dump, each as its frames, most recent first."""
    out: list[list[Frame]] = []
    for block in re.split(r"\n\s*\n|(?=^(?:Current thread|Thread) 0x)", dump, flags=re.MULTILINE):
        frames = []
        for line in block.splitlines():
            m = _FRAME.match(line) or _PYSPY_FRAME.match(line)
            if m:
                frames.append(Frame(m["file"], int(m["line"]), m["func"]))
        if frames:
            out.append(frames)
    return out


def training_thread(dump: str) -> list[Frame] | None:
    """The rank's training thread (it runs `RankActor._run`); None when the dump lacks it (cut short: a
    rank under load can pause mid-dump). Another thread's stack would place the rank wrongly: its courier
    thread waits on an event, which reads as "not in a collective" whatever the training thread does."""
    for frames in threads(dump):
        if any(f.file.endswith(_ENTRY[0]) and f.func == _ENTRY[1] for f in frames):
            return frames
    return None


@dataclass(frozen=True)
class Position:
    """Where a rank's training thread is: `collective` (a torch.distributed function) called from `site`,
    or not in a collective at `site`."""

    collective: str | None
    site: Frame | None

    def describe(self) -> str:
        where = str(self.site) if self.site else "an unknown place"
        if self.collective is None:
            return f"not in a collective, at {where}"
        return f"in {self.collective} called at {where}"


def _is_torch(frame: Frame) -> bool:
    return "/torch/" in frame.file or frame.file.startswith("<frozen")


def position(frames: list[Frame]) -> Position:
    for i, frame in enumerate(frames):
        if any(part in frame.file for part in _COLLECTIVE_FILES):
            # The outermost consecutive torch.distributed frame is the collective the caller asked for.
            j = i
            while j + 1 < len(frames) and any(part in frames[j + 1].file for part in _COLLECTIVE_FILES):
                j += 1
            # ... less the decorators around it (c10d's logger `wrapper`).
            named = [f.func for f in frames[i : j + 1] if f.func not in _WRAPPERS]
            collective = named[-1] if named else frames[j].func
            site = next((f for f in frames[j + 1 :] if not _is_torch(f)), None)
            return Position(collective, site)
    return Position(None, frames[0] if frames else None)


def _unplaced(dump: str | None) -> str:
    """Why a rank has no position."""
    if dump:
        return "gave a stack dump without its training thread (cut short)"
    return "gave no stacks (frozen or stuck in the kernel)"


@dataclass(frozen=True)
class HangReport:
    behind: tuple[int, ...]  # the ranks the others wait for (empty: it cannot tell)
    summary: str  # one line: who is behind and where
    positions: dict[int, str]  # rank -> where it is, one line each
    collectives: Lag | None = field(default=None)  # from the flight records, when there were any


def attribute(
    stacks: dict[int, str | None],
    world_size: int,
    returned: frozenset[int] = frozenset(),
    collectives: Mapping[int, Snapshot | None] | None = None,
) -> HangReport:
    """Who is behind, from each rank's dump (None: the rank gave none) and, with `collectives`, each rank's
    flight-recorder snapshot; `returned` ranks finished their run and are left out."""
    positions: dict[int, Position | None] = {}
    for rank in range(world_size):
        if rank in returned:
            continue
        dump = stacks.get(rank)
        frames = training_thread(dump) if dump else None
        positions[rank] = position(frames) if frames else None
    silent = [r for r, p in positions.items() if p is None]
    outside = [r for r, p in positions.items() if p is not None and p.collective is None]
    waiting = {r: p for r, p in positions.items() if p is not None and p.collective is not None}
    lines = {r: p.describe() if p is not None else _unplaced(stacks.get(r)) for r, p in positions.items()}
    parts: list[str] = []
    behind: list[int] = []
    if outside:
        behind += outside
        parts += [f"rank {r} is behind, {lines[r]}" for r in outside]
    if silent:
        behind += silent
        parts += [f"rank {r} {lines[r]}" for r in silent]
    groups = Counter((p.collective, str(p.site)) for p in waiting.values())
    if behind:
        if waiting:
            r0 = min(waiting)
            others = sorted(waiting)
            parts.append(
                f"ranks {others} wait for it {lines[r0]}"
                if len(groups) == 1
                else "the others wait in collectives: " + "; ".join(f"rank {r} {lines[r]}" for r in others)
            )
    elif len(groups) > 1:
        common, _ = groups.most_common(1)[0]
        odd = sorted(r for r, p in waiting.items() if (p.collective, str(p.site)) != common)
        if len(odd) * 2 == len(waiting):  # no majority: name each side
            odd = []
        behind += odd
        parts.append(
            "ranks wait in different collectives (a rank skipped or added one): "
            + "; ".join(f"rank {r} {lines[r]}" for r in sorted(waiting))
        )
    elif waiting:
        r0 = min(waiting)
        parts.append(f"every rank waits {lines[r0]}: a collective that does not complete (network, device)")
    else:
        parts.append("no rank gave stacks")
    lag = None
    if collectives is not None:
        lag = lagging(collectives, list(positions))
        if lag.findings:
            parts.append("flight recorder: " + "; ".join(lag.findings))
        elif any(s is not None and s.missing is None for s in collectives.values()):
            parts.append("flight recorder: no group with a collective pending")
        if lag.behind and (not behind or set(behind) >= set(positions)):
            # The stacks single out nobody (every rank outside a collective: on NCCL, blocked in a CUDA
            # sync after enqueuing its collectives); the sequence numbers do.
            behind = list(lag.behind)
    return HangReport(tuple(sorted(behind)), "; ".join(parts), lines, lag)


_SHOWN = 24  # recorded collectives per rank in the hang file


def _recorded(c: Collective) -> str:
    return f"  {c.backend} group {c.group}: {c.describe()} {c.state}"


def render(
    report: HangReport,
    stacks: dict[int, str | None],
    reason: str,
    collectives: Mapping[int, Snapshot | None] | None = None,
) -> str:
    """The hang file's text: the failure, the attribution, each rank's position, its last collectives
    and its whole dump."""
    out = [reason, report.summary, ""]
    out += [f"rank {r}: {line}" for r, line in sorted(report.positions.items())]
    if report.collectives is not None:
        out += ["", "collectives (flight recorder):"]
        out += [f"rank {r}: {line}" for r, line in sorted(report.collectives.ranks.items())]
        for rank in sorted(report.collectives.ranks):
            snap = (collectives or {}).get(rank)
            if snap is not None and snap.collectives:
                out += ["", f"==== rank {rank}: last collectives, oldest first ===="]
                out += [_recorded(c) for c in snap.collectives[-_SHOWN:]]
    for rank in sorted(report.positions):
        out += ["", f"==== rank {rank} ====", (stacks.get(rank) or "(no stacks)").rstrip()]
    return "\n".join(out) + "\n"
