"""Each rank's last collectives, from torch's flight recorder, and which rank lags among them.

torch records every collective of a process group in a ring buffer per process (the flight recorder): the
op, the process group, its sequence number in that group, the tensors' sizes and dtypes, and how far it
got. torch 2.11 and 2.13 keep `TORCH_FR_BUFFER_SIZE` entries (older name `TORCH_NCCL_TRACE_BUFFER_SIZE`),
2000 unless set; 0 turns it off. The size is read when the first process group is created, so `enable`
runs just before (`d9d.core.context.init_process_group`). It is on by default in torch itself, so there is
no setting here: `enable` only keeps it on where neither variable was set, and a user's 0 is respected.

There are two recorders per process, both read here (`snapshot`):

- gloo (a gloo process group, and the CPU side of `cuda:nccl,cpu:gloo`: the object collectives), read
  with `torch._C._distributed_c10d._dump_fr_trace_json`. Gloo has no device events: its `state` stays
  `scheduled`, and the entry is *retired* when the work finishes (shortly after the caller's `wait()`
  returned, on gloo's thread);
- NCCL (CUDA builds only), `_dump_nccl_trace_json`: its watchdog queries each collective's CUDA events, so
  `state` goes `scheduled` -> `started` (with `TORCH_NCCL_ENABLE_TIMING`) -> `completed`; an entry retired
  but not completed timed out.

Both also have a pickle variant (`_dump_fr_trace`, `_dump_nccl_trace`); the JSON ones are used, so nothing
is unpickled. The JSON's shape is torch's `FlightRecorder::dump_json` (FlightRecorderDetail.hpp, dump
version "2.10" in both torch versions): `entries` (absent when empty), `pg_config` (NCCL only: each group's
name, description and global ranks), `pg_status`, `version`. A group's collectives and its point-to-point
ops are numbered separately (`collective_seq_id`, `p2p_seq_id`), and gloo and NCCL number the same group
separately, so a collective here is known by (backend, group, sequence number).

A rank stuck in a collective cannot run a Python signal handler (those run on the main thread, between
bytecodes), so `serve` answers a local socket from a daemon thread: gloo's and NCCL's waits release the
GIL, so the snapshot comes while the training thread waits. `fetch(pid)` reads it from another process on
the node. `lagging` compares the ranks' snapshots.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# torch is imported where a snapshot is taken, in the rank: the reading side (`fetch`, `Snapshot.from_json`,
# `lagging`) runs in a fresh Ray worker on the node, where a cold torch import would delay the hang report.
_log = logging.getLogger(__name__)

BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # torch reads them in this order
DEFAULT_ENTRIES = 2000  # torch's own default (FlightRecorder.hpp), kept where nothing was set
KEEP = 32  # entries kept per (backend, group) in a snapshot: the frontier is in the last few
FORMAT = 1  # of `snapshot`'s JSON


def enable() -> None:
    """Keep the flight recorder on for the process groups created after this call (unless the user set
    its size: 0 turns it off)."""
    if not any(name in os.environ for name in BUFFER_ENV):
        os.environ[BUFFER_ENV[0]] = str(DEFAULT_ENTRIES)


def buffer_size() -> int:
    for name in BUFFER_ENV:
        if name in os.environ:
            with contextlib.suppress(ValueError):
                return int(os.environ[name])
    return DEFAULT_ENTRIES


# -- one process: what its recorders hold ---------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    desc: str  # torch's description: "default_pg", "undefined", a mesh dimension's name
    ranks: tuple[int, ...]  # global ranks; () when not known


@dataclass(frozen=True)
class Collective:
    backend: str  # "gloo" or "nccl": each numbers a group's collectives on its own
    group: str  # the process group's name (the same on every member)
    seq: int  # collective_seq_id, or p2p_seq_id for a point-to-point op
    p2p: bool
    op: str  # "all_reduce", "broadcast", "send", ...
    # "completed"; NCCL: "scheduled" or "started"; gloo: "pending" (it tells nothing finer); "timed out"
    state: str
    sizes: tuple[tuple[int, ...], ...]  # the input tensors' shapes
    dtypes: tuple[str, ...]
    created_ns: int  # wall clock, when the rank issued it

    @property
    def completed(self) -> bool:
        return self.state == "completed"

    def shape(self) -> str:
        if not self.sizes:
            return ""
        dtype = self.dtypes[0] if self.dtypes else "?"
        more = f" +{len(self.sizes) - 1}" if len(self.sizes) > 1 else ""
        return f" {dtype}{list(self.sizes[0])}{more}"

    def describe(self) -> str:
        kind = "p2p " if self.p2p else ""
        return f"{kind}#{self.seq} {self.op}{self.shape()}"


@dataclass(frozen=True)
class Snapshot:
    """One rank's recorded collectives (the last `KEEP` of each backend's group) and the groups it knows;
    `missing` says why there are none (the recorder is off, this torch has no JSON dump)."""

    collectives: tuple[Collective, ...] = ()
    groups: Mapping[str, Group] = field(default_factory=dict)
    buffer_size: int = DEFAULT_ENTRIES
    missing: str | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "buffer_size": self.buffer_size,
                "missing": self.missing,
                "groups": {n: {"desc": g.desc, "ranks": list(g.ranks)} for n, g in self.groups.items()},
                "collectives": [
                    {
                        "backend": c.backend,
                        "group": c.group,
                        "seq": c.seq,
                        "p2p": c.p2p,
                        "op": c.op,
                        "state": c.state,
                        "sizes": [list(s) for s in c.sizes],
                        "dtypes": list(c.dtypes),
                        "created_ns": c.created_ns,
                    }
                    for c in self.collectives
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Snapshot:
        """A snapshot from `to_json`'s text (JSON only: it comes from another process)."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"not a flight-recorder snapshot of format {FORMAT}")
        groups = {
            str(n): Group(str(g.get("desc", "")), tuple(int(r) for r in g.get("ranks", ())))
            for n, g in dict(raw.get("groups") or {}).items()
        }
        collectives = tuple(
            Collective(
                backend=str(c["backend"]),
                group=str(c["group"]),
                seq=int(c["seq"]),
                p2p=bool(c["p2p"]),
                op=str(c["op"]),
                state=str(c["state"]),
                sizes=tuple(tuple(int(d) for d in s) for s in c.get("sizes", ())),
                dtypes=tuple(str(d) for d in c.get("dtypes", ())),
                created_ns=int(c.get("created_ns", 0)),
            )
            for c in raw.get("collectives") or ()
        )
        missing = raw.get("missing")
        return cls(
            collectives, groups, int(raw.get("buffer_size", DEFAULT_ENTRIES)), missing and str(missing)
        )


def parse_dump(
    dump: Mapping[str, Any], backend: str, keep: int = KEEP
) -> tuple[list[Collective], dict[str, Group]]:
    """The collectives of one recorder's JSON dump (torch's `dump_json` shape), the last `keep` of each
    group (collectives and p2p ops each), and the groups its `pg_config` names (NCCL's; gloo's is empty)."""
    entries = dump.get("entries") or []
    out: list[Collective] = []
    for e in entries:
        name = str(e.get("profiling_name", "?"))
        p2p = bool(e.get("is_p2p", False))
        group = e.get("process_group") or ["?", ""]
        state = str(e.get("state", "scheduled"))
        retired = bool(e.get("retired", False))
        if backend == "gloo":
            # No events: a finished work is retired, nothing else changes (see the module's docstring).
            state = "completed" if retired or state == "completed" else "pending"
        elif retired and state != "completed":
            state = "timed out"
        out.append(
            Collective(
                backend=backend,
                group=str(group[0]),
                seq=int(e.get("p2p_seq_id" if p2p else "collective_seq_id", 0)),
                p2p=p2p,
                op=name.split(":", 1)[1] if ":" in name else name,
                state=state,
                sizes=tuple(tuple(int(d) for d in s) for s in e.get("input_sizes") or ()),
                dtypes=tuple(str(d) for d in e.get("input_dtypes") or ()),
                created_ns=int(e.get("time_created_ns", 0)),
            )
        )
    by_key: dict[tuple[str, bool], list[Collective]] = defaultdict(list)
    for c in out:
        by_key[(c.group, c.p2p)].append(c)
    kept = [c for cs in by_key.values() for c in sorted(cs, key=lambda c: c.seq)[-keep:]]
    groups: dict[str, Group] = {}
    for name, config in dict(dump.get("pg_config") or {}).items():
        ranks = _ranks(str(config.get("ranks", "[]")))
        if name and ranks:
            groups[str(name)] = Group(str(config.get("desc", "")), ranks)
    return sorted(kept, key=lambda c: c.created_ns), groups


def _ranks(text: str) -> tuple[int, ...]:
    """torch's `ranks_str`: "[0, 1, 2]"."""
    inner = text.strip().strip("[]")
    return tuple(int(r) for r in inner.split(",") if r.strip()) if inner.strip() else ()


def _python_groups() -> dict[str, Group]:
    """Every process group of this process with its global ranks, from torch.distributed's registry: the
    gloo recorder does not record them. `_world` is private; without it the groups are told by who
    recorded in them."""
    import torch.distributed as dist

    groups: dict[str, Group] = {}
    if not dist.is_available() or not dist.is_initialized():
        return groups
    with contextlib.suppress(Exception):  # a private registry, read from another thread than its writer
        names = dict(dist.distributed_c10d._world.pg_names)
        for pg, name in names.items():
            groups[str(name)] = Group(
                str(getattr(pg, "group_desc", "")), tuple(dist.get_process_group_ranks(pg))
            )
    return groups


def snapshot(keep: int = KEEP) -> Snapshot:
    """This process's recorded collectives, from both recorders."""
    size = buffer_size()
    if size <= 0:
        return Snapshot(buffer_size=size, missing="the flight recorder is off (TORCH_FR_BUFFER_SIZE=0)")
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return Snapshot(buffer_size=size, missing="this torch has no torch.distributed")
    dumps = [
        ("gloo", getattr(c10d, "_dump_fr_trace_json", None)),
        ("nccl", getattr(c10d, "_dump_nccl_trace_json", None)),
    ]
    if all(dump is None for _, dump in dumps):
        return Snapshot(buffer_size=size, missing="this torch has no JSON flight-recorder dump")
    collectives: list[Collective] = []
    groups = _python_groups()
    errors = []
    for backend, dump in dumps:
        if dump is None:
            continue
        try:
            found, known = parse_dump(json.loads(dump()), backend, keep)
        except Exception as e:  # one recorder failing leaves the other's record
            errors.append(f"{backend}: {e}")
            continue
        collectives += found
        for name, group in known.items():
            groups.setdefault(name, group)
    collectives.sort(key=lambda c: c.created_ns)
    missing = "; ".join(errors) if errors and not collectives else None
    return Snapshot(tuple(collectives), groups, size, missing)


# -- serving it to the node -----------------------------------------------------------------------------


def address(pid: int) -> str:
    """The socket where process `pid` serves its snapshot: on Linux in the abstract namespace (no file to
    leave behind, gone with the process), elsewhere a file under /tmp (not $TMPDIR: the reader may run in
    another runtime environment)."""
    if sys.platform.startswith("linux"):
        return f"\0d9d-flight-recorder-{pid}"
    return f"/tmp/d9d-flight-recorder-{pid}.sock"


class _Server:
    def __init__(self, sock: socket.socket, path: str) -> None:
        self._sock = sock
        self._path = path
        self._thread = threading.Thread(target=self._loop, name="d9d-flight-recorder", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    if _same_user(conn):
                        conn.sendall(snapshot().to_json().encode())
                except Exception:  # the reader went away, a recorder failed: the next request may work
                    _log.debug("flight-recorder request failed", exc_info=True)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not on Linux)
        self._sock.close()
        self._thread.join(timeout=2.0)
        if not self._path.startswith("\0"):
            with contextlib.suppress(OSError):
                os.unlink(self._path)


def _same_user(conn: socket.socket) -> bool:
    """Answer only processes of this user (the snapshot names the job's groups and shapes); where the
    peer's credentials cannot be read (not Linux), the socket file's mode restricts it instead."""
    if not hasattr(socket, "SO_PEERCRED"):
        return True
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return bool(uid == os.getuid())


_server: _Server | None = None
_server_lock = threading.Lock()


def serve() -> None:
    """Answer `fetch(os.getpid())` with this process's snapshot from a daemon thread, until `stop_serving`
    (idempotent: one server per process)."""
    global _server
    with _server_lock:
        if _server is not None:
            return
        path = address(os.getpid())
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if not path.startswith("\0"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a dead process of the same pid left it
            sock.bind(path)
            if not path.startswith("\0"):
                os.chmod(path, 0o600)
            sock.listen(8)
        except OSError:
            sock.close()
            raise
        _server = _Server(sock, path)


def stop_serving() -> None:
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


def fetch(pid: int, timeout_s: float = 3.0) -> Snapshot:
    """The snapshot process `pid` on this node serves; raises OSError (`TimeoutError` when it did not
    answer in time: frozen, or a thread holds the GIL) and ValueError (not a snapshot)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(address(pid))
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    return Snapshot.from_json(b"".join(chunks).decode())


# -- every rank: who lags ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lag:
    """What the ranks' flight records say: `behind`, the ranks whose sequence number lags in a group or
    whose collective at a number differs from the others'; `findings`, one line each; `ranks`, each rank's
    last completed and oldest pending collective."""

    behind: tuple[int, ...]
    findings: tuple[str, ...]
    ranks: dict[int, str]


def group_label(backend: str, name: str, groups: Mapping[str, Group]) -> str:
    desc = groups[name].desc if name in groups and groups[name].desc else ""
    return f"group {name} ({desc + ', ' if desc else ''}{backend})"


def rank_line(snap: Snapshot | None, groups: Mapping[str, Group]) -> str:
    """Where one rank's collectives stand: its last completed one and the oldest it waits in."""
    if snap is None:
        return "no flight record (it did not answer)"
    if snap.missing is not None:
        return f"no flight record ({snap.missing})"
    if not snap.collectives:
        return "no collective recorded"
    done = [c for c in snap.collectives if c.completed]
    waiting = [c for c in snap.collectives if not c.completed]
    parts = []
    if done:
        last = max(done, key=lambda c: c.created_ns)
        parts.append(f"last completed {last.describe()} in {group_label(last.backend, last.group, groups)}")
    else:
        parts.append("no completed collective recorded")
    if waiting:
        first = min(waiting, key=lambda c: c.created_ns)
        more = f" (+{len(waiting) - 1} more pending)" if len(waiting) > 1 else ""
        where = group_label(first.backend, first.group, groups)
        parts.append(f"waits in {first.describe()} ({first.state}) in {where}{more}")
    else:
        parts.append("nothing pending")
    return "; ".join(parts)


def lagging(snapshots: Mapping[int, Snapshot | None], ranks: Sequence[int]) -> Lag:
    """Compare the ranks' collective sequence numbers, group by group (`ranks`: those expected to be in the
    job; a rank's snapshot None: it gave none).

    In each group (per backend) where something is pending, over its members that gave a record:
    - a member whose last issued collective is older than the others' is *behind* — it never reached the
      collective the others wait in (it skipped it, or it is stuck before it);
    - members that issued the same number but recorded different ops there disagree (a rank skipped or
      added a collective and the numbers line up wrongly since); the minority is named when there is one;
    - when every member waits in the same collective, it does not complete (network, device).
    Point-to-point ops are listed per rank but not compared: their numbers count a group's sends and
    receives together, which differ between the ranks by design.
    """
    usable = {r: s for r, s in snapshots.items() if s is not None and s.missing is None}
    groups: dict[str, Group] = {}
    for s in usable.values():
        for name, group in s.groups.items():
            if group.ranks:
                groups.setdefault(name, group)
    lines = {r: rank_line(snapshots.get(r), groups) for r in ranks}
    keys = sorted({(c.backend, c.group) for s in usable.values() for c in s.collectives if not c.p2p})
    behind: set[int] = set()
    findings: list[str] = []
    for backend, name in keys:
        known = groups.get(name)
        recorded = {
            r
            for r, s in usable.items()
            if any(c.group == name and c.backend == backend for c in s.collectives)
        }
        members = [r for r in (known.ranks if known else sorted(recorded)) if r in usable and r in ranks]
        if len(members) < 2:
            continue
        ops: dict[int, dict[int, Collective]] = {
            r: {
                c.seq: c
                for c in usable[r].collectives
                if c.group == name and c.backend == backend and not c.p2p
            }
            for r in members
        }
        issued = {r: max(ops[r], default=0) for r in members}
        done = {r: max((s for s, c in ops[r].items() if c.completed), default=0) for r in members}
        if all(issued[r] == done[r] for r in members) and len(set(issued.values())) == 1:
            continue  # quiet: nothing pending, everyone at the same number
        label = group_label(backend, name, groups)
        found = _disagreement(label, ops, min(done.values()), max(issued.values()))
        if found is not None:  # the numbers line up wrongly from there on: no lag to read from them
            line, odd = found
            findings.append(line)
            behind.update(odd)
            continue
        lines_, laggers = _lag(label, ops, issued, done)
        findings += lines_
        behind.update(laggers)
    return Lag(tuple(sorted(behind)), tuple(findings), lines)


def _disagreement(
    label: str, ops: Mapping[int, Mapping[int, Collective]], low: int, front: int
) -> tuple[str, list[int]] | None:
    """The first number above `low` (every member completed up to it) at which the members recorded
    different ops, and the minority there (none without a majority)."""
    for seq in sorted({s for by_seq in ops.values() for s in by_seq if low < s <= front}):
        at = {r: by_seq[seq] for r, by_seq in ops.items() if seq in by_seq}
        kinds = Counter(c.op for c in at.values())
        if len(kinds) < 2:
            continue
        (common, count), *_ = kinds.most_common()
        odd = sorted(r for r, c in at.items() if c.op != common) if count * 2 > len(at) else []
        said = "; ".join(f"rank {r} {c.op}{c.shape()} ({c.state})" for r, c in sorted(at.items()))
        return f"{label}: the ranks disagree on collective #{seq} ({said}): a rank skipped or added one", odd
    return None


def _lag(
    label: str,
    ops: Mapping[int, Mapping[int, Collective]],
    issued: Mapping[int, int],
    done: Mapping[int, int],
) -> tuple[list[str], list[int]]:
    """Members whose last issued number is below the others' (they never reached the collective the
    others wait in); else, when every member waits at the same number, that collective."""
    front = max(issued.values())
    laggers = sorted(r for r in issued if issued[r] < front)
    ahead = sorted(r for r in issued if issued[r] == front)
    first = ahead[0]
    waited = ops[first].get(min((s for s in ops[first] if s > done[first]), default=front))
    if waited is None:  # the front rank completed its last one (a collective its peers never joined?)
        return [], []
    if laggers:
        lines = []
        for r in laggers:
            last = ops[r].get(issued[r])
            what = f"#{last.seq} {last.op} ({last.state})" if last is not None else "none recorded"
            lines.append(
                f"{label}: rank {r} is behind, its last collective is {what}; "
                f"{_ranks_text(ahead)} issued up to #{front} and wait{'s' if len(ahead) == 1 else ''} in "
                f"#{waited.seq} {waited.op}{waited.shape()}"
            )
        return lines, laggers
    waits = {r: min((s for s in ops[r] if s > done[r]), default=None) for r in issued}
    if len(set(waits.values())) == 1 and waited.seq == waits[first]:
        return [
            f"{label}: every rank waits in #{waited.seq} {waited.op}{waited.shape()}: the collective itself "
            "does not complete (network, device)"
        ], []
    return [], []


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"
