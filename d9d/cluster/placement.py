"""Placement: one bundle per rank, and which bundle each rank gets.

Ray decides which node each bundle lands on; we decide which rank goes to which bundle. Ranks are laid out
with pipeline outermost and the expert/tensor dims innermost, so a pipeline stage's ranks and an expert
group are runs of consecutive ranks. Giving each node a consecutive block of ranks (the node holding the
most bundles first, so rank 0 sits with the largest block) keeps those groups on one node whenever they
fit, and their collectives off the network.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from d9d.cluster.config import RankResources

if TYPE_CHECKING:
    from d9d.cluster.rank import RankNode


def placement_group_name(run_name: str, token: str) -> str:
    """Every placement group of a run carries the run's name, so one whose coordinator died can still be
    found (`ray.util.placement_group_table()`) and removed; `token` keeps the names of a run's groups
    apart."""
    return f"d9d/{run_name}/{token}"


def run_placement_groups(table: Mapping[str, Mapping[str, Any]], run_name: str) -> list[str]:
    """Ids of the run's placement groups in `placement_group_table()` that are not removed yet."""
    prefix = placement_group_name(run_name, "")
    return [
        pg_id
        for pg_id, info in table.items()
        if str(info.get("name", "")).startswith(prefix) and info.get("state") != "REMOVED"
    ]


def bundle_for(resources: RankResources) -> dict[str, float]:
    bundle = {"CPU": float(resources.cpus)}
    if resources.gpus:
        bundle["GPU"] = float(resources.gpus)
    return bundle


def assign_bundles(bundle_nodes: Sequence[str]) -> list[int]:
    """rank -> bundle index, giving every node a consecutive block of ranks."""
    by_node: dict[str, list[int]] = {}
    for index, node in enumerate(bundle_nodes):
        by_node.setdefault(node, []).append(index)
    blocks = sorted(by_node.values(), key=len, reverse=True)  # stable: ties keep Ray's order
    return [index for block in blocks for index in block]


def local_ranks(rank_nodes: Sequence[str]) -> list[tuple[int, int]]:
    """(local rank, local world size) of each rank from the node it runs on."""
    counts: dict[str, int] = {}
    seen: dict[str, int] = {}
    for node in rank_nodes:
        counts[node] = counts.get(node, 0) + 1
    out = []
    for node in rank_nodes:
        out.append((seen.get(node, 0), counts[node]))
        seen[node] = seen.get(node, 0) + 1
    return out


def node_capacity(nodes: Sequence[Mapping[str, Any]], resources: RankResources) -> int:
    """How many rank bundles the alive nodes of `ray.nodes()` can hold, counting each node separately."""
    need = bundle_for(resources)
    total = 0
    for node in nodes:
        if not node.get("Alive", False):
            continue
        have: Mapping[str, float] = node.get("Resources", {})
        total += int(min(have.get(key, 0.0) // amount for key, amount in need.items()))
    return total


def free_capacity(available: Mapping[str, float], resources: RankResources) -> int:
    """Extra rank bundles the cluster's free resources (`ray.available_resources()`) could hold."""
    return int(min(available.get(key, 0.0) // amount for key, amount in bundle_for(resources).items()))


def device_placement(nodes: Sequence[RankNode], *, gpus: bool) -> list[tuple[int, int, str | None]]:
    """(local rank, local world size, CUDA_VISIBLE_DEVICES) per rank.

    GPU ranks on one node all see that node's job GPUs, and a rank's local rank is the index of the GPU
    Ray gave it among them, so `cuda:<LOCAL_RANK>` is exactly its own device.
    """
    if not gpus:
        return [(local, size, None) for local, size in local_ranks([n.node_id for n in nodes])]
    per_node: dict[str, list[str]] = {}
    for n in nodes:
        per_node.setdefault(n.node_id, []).extend(n.gpu_ids)
    out: list[tuple[int, int, str | None]] = []
    for n in nodes:
        ids = sorted(per_node[n.node_id], key=lambda g: (len(g), g))
        out.append((ids.index(n.gpu_ids[0]), len(ids), ",".join(ids)))
    return out
