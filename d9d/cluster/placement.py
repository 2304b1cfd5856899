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
from d9d.engine.config import ConfigError

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


class PlacementError(ConfigError):
    """The run's ranks cannot be placed on the cluster (`placement_shortfall` says why, in one line)."""


def _amounts(amounts: Mapping[str, float], joiner: str) -> str:
    return joiner.join(f"{amount:g} {key}" for key, amount in amounts.items())


def placement_shortfall(
    nodes: Sequence[Mapping[str, Any]],
    resources: RankResources,
    world_sizes: Sequence[int],
    *,
    available: Mapping[str, float] | None = None,
    strategy: str = "PACK",
) -> str:
    """Why `world_sizes` rank bundles (tried in turn, largest first) do not fit on the cluster whose nodes
    `ray.nodes()` lists, in one line: what the run asks for and what the alive nodes have. `available`
    (`ray.available_resources()`), when given, tells room that other jobs hold from room that is free."""
    need = bundle_for(resources)
    sizes = sorted(set(world_sizes), reverse=True)
    count = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]} (or at least {sizes[-1]})"
    alive = [n for n in nodes if n.get("Alive", False)]
    totals = {key: sum(float(n.get("Resources", {}).get(key, 0.0)) for n in alive) for key in need}
    capacity = node_capacity(nodes, resources)
    asked = f"needs {count} rank bundles of {_amounts(need, ' + ')} each (cluster.resources)"
    have = (
        f"the cluster's {len(alive)} alive node{'' if len(alive) == 1 else 's'} "
        f"{'has' if len(alive) == 1 else 'have'} {_amounts(totals, ', ')} in all"
    )
    if capacity < sizes[-1]:
        room = f"room for {capacity} such bundles (each must fit on one node)"
    elif available is not None and (free := free_capacity(available, resources)) < sizes[-1]:
        room = (
            f"room for {capacity} such bundles, {free} of them free now (other actors or jobs hold the rest)"
        )
    else:
        room = f"room for {capacity} such bundles, yet Ray did not place them ({strategy} placement)"
    return f"{asked}; {have}, {room}"


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
