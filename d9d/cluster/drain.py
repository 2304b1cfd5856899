"""Node drain notices from Ray: a rank's node about to go is a preemption, as SIGTERM to the driver is.

Before a node is taken away on purpose — a spot or preemptible VM's preemption notice, a scale-down, an
operator's `ray drain-node` — Ray's GCS marks it *draining*, with the deadline after which it will be
killed. Ray then schedules nothing new there and kills nothing itself: the node's actors run until the node
goes. Ray 2.60 says which nodes are draining only through an API that is not public: the GCS's
`get_draining_nodes` (node id -> deadline in ms, 0 for none), reached through `ray._private.state`, which
Ray's own Serve and Data libraries poll for the same purpose. It reports no reason (the drain request has
one, but it is not read back); an idle-termination drain is refused for a node that runs anything, so a
node that holds a rank and is draining is being taken away.

`draining_nodes` isolates that call: when it is missing or fails (another Ray), it returns None and the
coordinator goes on without node notices (it says so once); `tests/test_cluster_drain.py` drains a real
node, so a Ray upgrade that changes it fails there rather than silently.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def draining_nodes() -> dict[str, float] | None:
    """Ray's draining nodes: node id (hex) -> the wall-clock deadline in seconds (inf: none given); None
    when this Ray does not tell (the private API is gone, or the call failed)."""
    try:
        from ray._private.state import state

        raw = state.get_draining_nodes()
        return {str(node): (int(ms) / 1000.0 if int(ms) > 0 else math.inf) for node, ms in raw.items()}
    except Exception:  # a private API: any failure means "not known", never the run's failure
        return None


@dataclass(frozen=True)
class DrainNotice:
    """Nodes of this run that are draining: which ranks (and whether the coordinator) run there, and the
    earliest deadline."""

    nodes: tuple[str, ...]
    ranks: tuple[int, ...]
    coordinator: bool
    deadline: float  # wall clock, seconds; inf: none given

    def remaining_s(self, now: float | None = None) -> float:
        return self.deadline - (time.time() if now is None else now)

    def reason(self, now: float | None = None) -> str:
        """`stop_reason` of the run it stops: it starts with "preempted", as the driver's signal does."""
        what = []
        if self.ranks:
            what.append(f"rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))}")
        if self.coordinator:
            what.append("the coordinator")
        nodes = ", ".join(n[:12] for n in self.nodes)
        left = self.remaining_s(now)
        deadline = "no deadline given" if math.isinf(left) else f"to be killed in {max(left, 0.0):.0f}s"
        plural = len(self.nodes) > 1
        return (
            f"preempted: node{'s' if plural else ''} {nodes} ({' and '.join(what)}) "
            f"{'are' if plural else 'is'} draining (Ray; {deadline})"
        )


def notice(
    draining: Mapping[str, float], rank_nodes: Sequence[str], coordinator_node: str | None
) -> DrainNotice | None:
    """The drain notice for this run: `rank_nodes[r]` is rank r's node id ("" while unknown), and the
    coordinator's own node counts too (its loss ends the run as well). None when none of them drains."""
    ranks = tuple(r for r, node in enumerate(rank_nodes) if node and node in draining)
    ours = {rank_nodes[r] for r in ranks}
    coordinator = coordinator_node is not None and coordinator_node in draining
    if coordinator:
        assert coordinator_node is not None
        ours.add(coordinator_node)
    if not ours:
        return None
    return DrainNotice(tuple(sorted(ours)), ranks, coordinator, min(draining[n] for n in ours))
